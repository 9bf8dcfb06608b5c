"""A Temporal namespace without llmgw's search attributes: the control worker
refuses to start and says how to register them, rather than running Replica
workflows whose every workflow task would fail on the upsert."""

import sysconfig
from pathlib import Path

from llmgw import search_attributes as sa
from llmgw_cli.procs import Child, wait_for
from tests.harness import System, free_port, port_open
from workflows.worker import CONFIG_EXIT


def test_the_control_worker_names_a_missing_search_attribute(tmp_path: Path) -> None:
    # A cluster upgraded without registering the newest attribute.
    older = [f"{k.name}=Keyword" for k in sa.ALL if k is not sa.REPLICA_UPDATED_AT]
    assert len(older) == len(sa.ALL) - 1
    port = free_port()
    argv = [
        str(Path(sysconfig.get_path("scripts")) / "temporal"),
        *("server", "start-dev", "--headless", "--port", str(port), "--log-level", "warn"),
        *("--db-filename", str(tmp_path / "t.db")),
        *(arg for flag in older for arg in ("--search-attribute", flag)),
    ]
    server = Child("temporal", argv, {}, tmp_path / "temporal.log")
    try:
        assert wait_for(lambda: port_open(port), 30), server.log_tail()
        system = System(f"127.0.0.1:{port}", tmp_path / "llmgw", free_port())
        control = system.spawn("control")
        try:
            assert wait_for(lambda: not control.alive(), 60), control.log_tail()
            assert control.exit_code() == CONFIG_EXIT, control.log_tail()
            log = control.log_path.read_text()
            assert "lacks search attributes ReplicaUpdatedAt" in log, log
            assert "--name ReplicaUpdatedAt --type Datetime" in log, log
            assert "Traceback" not in log, log
        finally:
            system.stop()
    finally:
        server.stop()
