"""``python -m llmgw_cli`` is the ``llmgw`` CLI."""

from llmgw_cli.app import main

main()
