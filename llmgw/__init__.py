"""llmgw: a control plane and OpenAI-compatible gateway for self-hosted LLM inference.

Shared pieces live here: the types that cross process boundaries, the error
hierarchy, key derivation, the store and the Temporal connection. Each process
(control worker, node agent, router, CLI) has its own package and settings.
"""

__version__ = "0.1.0"
LAYER = "core"  # this package's layer in the dependency rule: tests/test_layers.py
