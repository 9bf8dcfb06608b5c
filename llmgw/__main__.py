"""``python -m llmgw`` is the ``llmgw`` CLI."""

from llmgw.cli import main

main()
