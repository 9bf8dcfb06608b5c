LAYER = "gateway"  # this package's layer in the dependency rule: tests/test_layers.py
