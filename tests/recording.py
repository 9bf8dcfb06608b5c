"""Recording workflow histories for the replay test (tests/control/test_replay.py).

Run the tests with ``LLMGW_RECORD_HISTORIES=1`` to (re)write the stored
histories from representative runs; normally this does nothing. Re-record
only on purpose: the point of the stored files is that they come from the
code as it was, so a change that breaks workflows in flight fails CI.
"""

import os
from pathlib import Path

from temporalio.client import Client

HISTORIES = Path(__file__).parent / "histories"


async def record(client: Client, workflow_id: str, name: str, run_id: str | None = None) -> None:
    """Store the history of ``workflow_id`` (one run) as ``histories/<name>.json``."""
    if not os.environ.get("LLMGW_RECORD_HISTORIES"):
        return
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    (HISTORIES / f"{name}.json").write_text(history.to_json())
