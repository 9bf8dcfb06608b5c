"""Inputs and outputs of the engine plans: what a shard is asked to be, and how to run it.

Everything here is a frozen pydantic model so it can cross a Temporal boundary
(the control plane plans a replica, an agent plans its own shard) and be
written to a spec file as JSON. Nothing here starts a process.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmgw.errors import ConfigError
from llmgw.types import EngineProfile, FabricKind, GpuInfo, ModelSpec, RdmaPort, Rendezvous

__all__ = [  # EngineProfile and Rendezvous cross Temporal, so they live in llmgw.types
    "REDACTED",
    "CommandSpec",
    "CompletionProbe",
    "Endpoint",
    "EngineProfile",
    "LaunchValidationError",
    "Launchers",
    "LoraAdapter",
    "NodeFacts",
    "ReadyProbe",
    "Rendezvous",
    "ShardPlan",
    "ShardRequest",
    "redacted",
    "vllm_module_launcher",
]

REDACTED = "<redacted>"

# Flags whose next argv element is a secret, for command lines that come back
# without their plan (read from /proc or an old spec file during adoption).
SECRET_FLAGS = frozenset({"--api-key", "--admin-api-key"})


class LaunchValidationError(ConfigError, ValueError):
    """A shard or replica that must not be started, with every reason found.

    Each problem says what to change; ``str()`` joins them so a workflow
    failure shows all of them at once rather than one per retry.
    """

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems) or "invalid launch")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# The subdirectory of a shard's scratch dir where llama.cpp saves slots
# (``--slot-save-path``: router/forwarding/slot_priming.py).
SLOTS_SUBDIR = "slots"


class NodeFacts(_Frozen):
    """What a shard's plan needs to know about the node it runs on."""

    host: str = Field(description="address the engine binds (HTTP, RPC server)")
    advertise_address: str = Field(default="", description="address peers reach this node at")
    management_interface: str = Field(
        default="", description="this node's own interface holding its management address"
    )
    http_port: int = Field(default=0, ge=0, le=65535)
    fabric: FabricKind = FabricKind.NONE
    rdma_ports: tuple[RdmaPort, ...] = Field(
        default=(), description="the ports of the chosen fabric"
    )
    gpu_indices: tuple[int, ...] = Field(default=(), description="NVML (PCI bus order) indices")
    gpus: tuple[GpuInfo, ...] = Field(
        default=(), description="the GpuInfo of gpu_indices, for validation"
    )
    threads: int = Field(default=0, ge=0, description="llama.cpp --threads; 0 leaves its default")
    cpu_threads_bind: str = Field(
        default="nobind",
        description="vLLM CPU VLLM_CPU_OMP_THREADS_BIND: a core list such as 0-7, or nobind",
    )
    http_host: str = Field(
        default="",
        description="where the HTTP API binds: loopback behind the agent's pass-through; "
        "empty means host",
    )
    kv_cache_bytes: int = Field(
        default=0, ge=0, description="vLLM on CPU: KV-cache size (--kv-cache-memory-bytes)"
    )
    scratch_dir: str = Field(
        default="", description="the shard's private TMPDIR and cache root; empty inherits"
    )

    @property
    def peer_address(self) -> str:
        """The address other nodes use for this one."""
        return self.advertise_address or self.host

    @property
    def http_bind(self) -> str:
        """The address the engine's HTTP API listens on."""
        return self.http_host or self.host


class LoraAdapter(_Frozen):
    """A catalog adapter loaded at start."""

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


class Launchers(_Frozen):
    """Where each engine's programs are: argv prefixes, so installs can differ per node.

    vLLM's prefix must end in ``serve`` (``vllm serve`` or ``python -m
    vllm.entrypoints.cli.main serve``) or be the api_server module, which is
    what the vllm-cpu packaging can run; that module ignores ``--headless``.
    """

    vllm: tuple[str, ...] = ("vllm", "serve")
    sglang: tuple[str, ...] = ("python", "-m", "sglang.launch_server")
    ray: tuple[str, ...] = ("ray",)
    llama_server: tuple[str, ...] = ("llama-server",)
    rpc_server: tuple[str, ...] = ("ggml-rpc-server",)


VLLM_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_module_launcher(python: str = "python") -> tuple[str, ...]:
    """vLLM's API server as a module, for installs without a working ``vllm`` script."""
    return (python, "-m", VLLM_API_SERVER_MODULE)


class ShardRequest(_Frozen):
    """One shard to plan: a model under a profile, at a rank, on a node."""

    model: ModelSpec
    profile: EngineProfile = Field(default_factory=EngineProfile)
    rank: int = Field(default=0, ge=0)
    node: NodeFacts
    rendezvous: Rendezvous | None = None
    loras: tuple[LoraAdapter, ...] = ()

    @model_validator(mode="after")
    def _rank_in_range(self) -> "ShardRequest":
        if self.rank >= self.profile.nodes:
            raise ValueError(f"rank {self.rank} of a {self.profile.nodes}-node replica")
        return self

    @property
    def multi_node(self) -> bool:
        """Whether the replica spans more than one node."""
        return self.profile.nodes > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the rank that serves HTTP and holds the rendezvous point."""
        return self.rank == 0


class Endpoint(_Frozen):
    """A TCP address that must accept connections before a command starts."""

    host: str
    port: int = Field(ge=1, le=65535)
    timeout_s: float = Field(default=600.0, gt=0)


class CommandSpec(_Frozen):
    """One process of a shard.

    ``wait_for``: every endpoint must be listening before this command starts;
    past ``timeout_s`` the shard fails rather than hangs. ``env`` is added to
    the plan's environment for this command only. ``secret_argv_indices``
    mark argv positions that hold a secret (SGLang's key).
    """

    name: str
    argv: tuple[str, ...]
    wait_for: tuple[Endpoint, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    secret_argv_indices: tuple[int, ...] = ()

    def redacted(self) -> list[str]:
        """The command line as it may be logged or written to a spec file."""
        return redacted(self.argv, self.secret_argv_indices)


class CompletionProbe(_Frozen):
    """One real generation: ``/health`` can answer 200 from an engine that dies generating."""

    path: str = "/v1/completions"
    prompt: str = "Hello"
    max_tokens: int = Field(default=1, ge=1)

    def body(self, model: str) -> dict[str, Any]:
        """The request body for the served model id ``model``."""
        return {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens}


class ReadyProbe(_Frozen):
    """How to tell a serving shard is ready: up, weights loaded, and able to generate."""

    health_path: str = "/health"
    models_path: str = "/v1/models"
    completion: CompletionProbe | None = Field(default_factory=CompletionProbe)


class ShardPlan(_Frozen):
    """How to run one shard.

    Every command but the last is a sidecar kept alive for the shard's lifetime
    and killed with it; the last one's exit is the shard's exit. A shard that
    does not serve HTTP (a worker rank) is judged by staying alive.
    """

    commands: tuple[CommandSpec, ...] = Field(min_length=1)
    env: dict[str, str]
    serves_http: bool
    http_port: int | None = None
    ready_probe: ReadyProbe | None = None
    secret_env: tuple[str, ...] = Field(default=(), description="env names never to log")
    lora_ids: dict[str, int] = Field(
        default_factory=dict, description='llama.cpp: adapter name -> per-request "lora" id'
    )

    @property
    def health_path(self) -> str | None:
        """The liveness path, or None for a shard that serves no HTTP."""
        return self.ready_probe.health_path if self.ready_probe else None

    def loggable(self) -> dict[str, Any]:
        """The plan with every secret replaced: for logs and spec files."""
        data = self.model_dump(mode="json")
        data["commands"] = [
            {**cmd, "argv": spec.redacted()}
            for cmd, spec in zip(data["commands"], self.commands, strict=True)
        ]
        data["env"] = {
            k: (REDACTED if k in self.secret_env else v) for k, v in sorted(self.env.items())
        }
        return data


def redacted(argv: Sequence[str], secret_indices: Iterable[int] = ()) -> list[str]:
    """``argv`` with secrets replaced by ``<redacted>``.

    Hides the marked positions and, because a command line may come back
    without its plan (read from ``/proc`` when adopting an engine), also the
    value of any known secret flag, in both ``--flag value`` and
    ``--flag=value`` form.
    """
    hidden = set(secret_indices)
    out = list(argv)
    for i, arg in enumerate(argv):
        flag, eq, _ = arg.partition("=")
        if eq and flag in SECRET_FLAGS:
            out[i] = f"{flag}={REDACTED}"
        elif arg in SECRET_FLAGS:
            hidden.add(i + 1)
    for i in hidden:
        if 0 <= i < len(out):
            out[i] = REDACTED
    return out
