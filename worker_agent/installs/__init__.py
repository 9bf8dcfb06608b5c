"""Engines installed on the node: llama.cpp at start-up, vLLM on first use, both cached."""
