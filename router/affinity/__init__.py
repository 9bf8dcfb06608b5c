"""Cache-aware routing: which replica of a model already holds a prompt's
prefix in its engine's cache (docs/guides/routing.md). Pure: no I/O, no
Temporal, no web framework; the proxy holds one :class:`Affinity`."""

LAYER = "gateway"  # this package's layer in the dependency rule: tests/test_layers.py
