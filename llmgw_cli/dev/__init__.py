"""Development and test support: tiny models generated on the spot (a llama
GGUF with LoRA adapters for llama.cpp, a Hugging Face-format model and a PEFT
adapter for vLLM). The product imports them only in ``llmgw up``, which
serves the tiny GGUF when no model is configured."""

LAYER = "cli"  # this package's layer in the dependency rule: tests/test_layers.py
