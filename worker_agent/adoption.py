"""What a (re)starting agent does about engines it finds on its node.

- An engine its spec file describes and whose fingerprint matches (same pid
  and start time, and this agent's engine marker in its environment where
  that is readable; never the command line, which a launcher's exec or a
  process title changes) is adopted: same pid, not restarted, watched by
  polling, stopped by signalling its group. Restarting it would drop every
  in-flight request for nothing.
- A spec file whose pid is gone, or now belongs to an unrelated process (the
  fingerprint differs), is a lost shard: the spec is dropped, the process is
  left alone - adopting or killing a stranger is worse than losing a shard.
- An adopted shard whose pass-through predates endpoint proofs (its record
  says so: ``ShardRecord.endpoint_proofs``) keeps running, but no router sends
  it a request, since it cannot prove it holds its replica's key: the agent
  warns, naming the command that replaces it (a roll), and the agent.adopt
  span lists it.
- A process carrying this node's engine marker that no spec file describes
  is killed, with its group: something holding GPUs that nothing can
  describe is worse than no process, because placement hands those GPUs out
  again.
"""

import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace

from llmgw.types import ShardRef
from worker_agent import procfs
from worker_agent.supervisor import ENGINE_MARKER, RunningShard, Supervisor

log = logging.getLogger(__name__)


@dataclass
class AdoptionReport:
    """What the scan found."""

    adopted: list[RunningShard] = field(default_factory=list)
    lost: list[ShardRef] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    # Adopted, serving, but not routed: pass-throughs from before endpoint proofs.
    unproven: list[ShardRef] = field(default_factory=list)


def marked_engines(marker: str, proc_root: Path = procfs.PROC) -> dict[int, int]:
    """pid → process group of every process carrying an agent's engine marker."""
    needle = f"{ENGINE_MARKER}={marker}".encode()
    found: dict[int, int] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ:
            try:
                found[int(entry.name)] = os.getpgid(int(entry.name))
            except ProcessLookupError:
                continue
    return found


def adopt(supervisor: Supervisor) -> AdoptionReport:
    """Adopt identified engines, drop lost shards, kill unidentified engines."""
    report = AdoptionReport()
    for ref in supervisor.recorded():
        running = supervisor.find_running(ref)
        if running is None:
            log.warning(
                "replica %s rank %d: engine gone or pid reused; shard lost",
                ref.replica_id,
                ref.rank,
            )
            supervisor.forget_lost(ref)
            report.lost.append(ref)
            continue
        supervisor.note_adopted(running)
        report.adopted.append(running)
        log.info("replica %s rank %d: adopted engine pid %d", ref.replica_id, ref.rank, running.pid)
        record = supervisor.plan_of(ref)
        if record.serves_http and not record.endpoint_proofs:
            log.warning(
                "replica %s: pass-through predates endpoint proofs; it is not routed "
                "until the model is rolled: llmgw restart %s",
                ref.replica_id,
                record.model or "MODEL",
            )
            report.unproven.append(ref)
    known_groups = {r.group for r in report.adopted}
    for pid, pgid in marked_engines(supervisor.marker).items():
        if pgid in known_groups or pgid in report.killed:
            continue
        log.warning("engine process %d (group %d) has no spec file: killing its group", pid, pgid)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        report.killed.append(pgid)
    # The agent's agent.adopt span (worker_agent/main.py), when adopt runs in it.
    trace.get_current_span().set_attribute(
        "llmgw.unproven", [r.replica_id for r in report.unproven]
    )
    return report
