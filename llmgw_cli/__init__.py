"""The ``llmgw`` command line, and what only it runs: ``llmgw up`` with its
process supervision, the benchmark, the store copy and the keys commands."""

LAYER = "cli"  # this package's layer in the dependency rule: tests/test_layers.py


def main() -> None:
    """Run the ``llmgw`` command (the console script's entry point)."""
    # Imported here so that importing a module of this package (the tests'
    # process helpers) does not load every command.
    from llmgw_cli.app import main as run  # noqa: PLC0415

    run()
