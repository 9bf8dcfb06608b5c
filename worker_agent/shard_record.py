"""What the agent keeps on disk about each shard it launched: ``spec.json``.

Written once per launch (worker_agent/supervisor.py), read back by the
launch's later steps (readiness, drain, load, core binding), by the node's
inventory report, by a restarted agent adopting its engines and by
``llmgw up`` cleaning up after a crash. Files outlive the code that wrote
them: every field a later version added has a default, and keys this
version does not know are ignored, so records written by older agents load
(tests/agent/test_supervisor.py loads one).
"""

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llmgw.types import ShardRef
from worker_agent.engines.spec import ReadyProbe


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ShardRecord(_Record):
    """What the launch decided about a shard: the ``spec`` of its spec file."""

    model: str = ""
    engine: str = ""
    gpu_indices: list[int] = Field(default_factory=list)
    priority: int = 0
    catalog_digest: str = ""
    # False: a worker rank, judged by staying alive rather than by answering.
    serves_http: bool = True
    ready_probe: ReadyProbe | None = None
    # The plan with its secrets redacted, for whoever debugs the node.
    plan: dict[str, Any] = Field(default_factory=dict)
    # The engine's own loopback port behind the pass-through (rank 0 only).
    internal_port: int | None = None
    cpu_bind: str = ""
    # Its pass-through answers the router's endpoint proofs (llmgw/endpoint_proof.py).
    # False in records from before them: routers send such a replica nothing
    # until the model is rolled (worker_agent/adoption.py warns at adoption).
    endpoint_proofs: bool = False


class RecordedFingerprint(_Record):
    """The engine process as launched: a reused pid differs in start time."""

    start_time: int | None = None
    # The argv launched, redacted (older agents recorded it in clear): for
    # whoever debugs the node, not compared (procfs.matches says why).
    cmdline: list[str] | None = None
    # The engine marker put in its environment (supervisor.ENGINE_MARKER's
    # value); None in records from before it was kept.
    marker: str | None = None


class SpecFile(_Record):
    """The whole ``spec.json``: which shard, which process, and its ShardRecord."""

    shard: ShardRef
    pid: int
    # 0 in records older than process groups: the leader's pid is the group.
    pgid: int = 0
    port: int
    endpoint: str
    fingerprint: RecordedFingerprint | None = None
    spec: ShardRecord = Field(default_factory=ShardRecord)
    # When the group's leader (the first command) started: a later process
    # given the group id as its pid differs (procfs.group_reused).
    group_start_time: int | None = None

    @property
    def group(self) -> int:
        """The process group holding the shard's processes."""
        return self.pgid or self.pid

    @property
    def leader_start(self) -> int | None:
        """The group leader's start time, where the record tells it."""
        if self.group_start_time is not None:
            return self.group_start_time
        if self.group == self.pid and self.fingerprint is not None:
            return self.fingerprint.start_time
        return None

    @classmethod
    def load(cls, path: Path) -> "SpecFile | None":
        """The record at ``path``; None when there is none or it is unreadable."""
        try:
            return cls.model_validate_json(path.read_text())
        except (FileNotFoundError, ValueError):
            return None
