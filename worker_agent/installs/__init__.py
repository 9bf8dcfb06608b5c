"""Engines installed on the node: llama.cpp at start-up, vLLM on first use, both cached."""

LAYER = "agent"  # this package's layer in the dependency rule: tests/test_layers.py
