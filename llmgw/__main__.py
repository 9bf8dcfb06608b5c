"""``python -m llmgw`` is the ``llmgw`` CLI."""

from llmgw.cli.app import main

main()
