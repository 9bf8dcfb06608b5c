"""What every engine plan shares: the interface, the base environment, small parsers."""

from collections.abc import Mapping
from typing import Protocol

from worker_agent.engines.nccl import OWNED_ENV
from worker_agent.engines.spec import (
    SLOTS_SUBDIR,
    Endpoint,
    LaunchValidationError,
    NodeFacts,
    Rendezvous,
    ShardPlan,
    ShardRequest,
)

# Addresses that mean "every interface" (or none at all) to a listener.
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", "[::]", ""})

# The agent's own settings (the store URL may carry a database password).
_PRIVATE_PREFIXES = ("LLMGW_",)

# Set by planners when wanted; inherited from the agent they would be wrong
# (another node's address, another replica's key or Ray cluster).
_ENGINE_OWNED = frozenset(
    {
        "VLLM_API_KEY",
        "LLAMA_API_KEY",
        "VLLM_HOST_IP",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_CPU_OMP_THREADS_BIND",
        # A legacy variable that overrides --kv-cache-memory-bytes (in whole GiB).
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CACHE_ROOT",
        "RAY_ADDRESS",
    }
)


class EnginePlanner(Protocol):
    """Builds the plan of one shard for one engine kind."""

    def plan(self, request: ShardRequest, key: str, base_env: Mapping[str, str]) -> ShardPlan:
        """The commands and environment of ``request``'s shard.

        ``key`` is the engine key ("" for none); ``base_env`` the agent's
        environment, of which only what engines may see is kept.
        """
        ...


class EnvHook(Protocol):
    """Adds what an engine install needs to run (e.g. its library path)."""

    def __call__(self, base: Mapping[str, str]) -> dict[str, str]: ...


def start_env(base_env: Mapping[str, str], hook: EnvHook | None) -> dict[str, str]:
    """The environment a plan starts from: the agent's, filtered, then the install's additions."""
    env = engine_base_env(base_env)
    return hook(env) if hook else env


def engine_base_env(agent_env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment minus its private settings and what plans decide."""
    return {
        k: v
        for k, v in agent_env.items()
        if not k.startswith(_PRIVATE_PREFIXES) and k not in OWNED_ENV | _ENGINE_OWNED
    }


def scratch_env(node: NodeFacts) -> dict[str, str]:
    """A private TMPDIR (and what else engines write outside their home) per shard.

    vLLM leaves ``/tmp/vllm_dist_*`` and torch's compile caches in TMPDIR, and
    ``~/.cache/vllm`` in its cache root: shared, two engines' files mix and
    outlive both.
    """
    if not node.scratch_dir:
        return {}
    return {
        "TMPDIR": f"{node.scratch_dir}/tmp",
        "VLLM_CACHE_ROOT": f"{node.scratch_dir}/cache/vllm",
    }


def slot_save_dir(node: NodeFacts) -> str:
    """The shard's private directory for llama.cpp slot saves (made with its
    scratch dir by the supervisor); empty: none."""
    return f"{node.scratch_dir}/{SLOTS_SUBDIR}" if node.scratch_dir else ""


def require_rendezvous(request: ShardRequest) -> Rendezvous:
    """The request's rendezvous; a multi-node shard without one cannot start."""
    if request.rendezvous is None:
        raise LaunchValidationError(
            [f"{request.model.name}: a {request.profile.nodes}-node replica needs a rendezvous"]
        )
    return request.rendezvous


def leader_endpoint(rdv: Rendezvous, port: int) -> Endpoint:
    """The leader's rendezvous point on ``port``, bounded by the rendezvous timeout."""
    if not rdv.leader_address or port <= 0:
        raise LaunchValidationError(
            ["the rendezvous needs the leader's address and port for worker ranks to join"]
        )
    return Endpoint(
        host=side_address(rdv.leader_address, "the rendezvous leader"),
        port=port,
        timeout_s=rdv.timeout_s,
    )


def side_address(address: str, what: str) -> str:
    """``address``, which a multi-node side port (ggml RPC, Ray, the leader's
    rendezvous) binds or advertises; a wildcard is refused.

    These ports carry unauthenticated engine traffic (README, "Trust
    boundary"): bound to every interface, anyone reaching any of the node's
    networks could drive the engine; advertised, peers could not reach it.
    """
    if address in WILDCARD_ADDRESSES:
        raise LaunchValidationError(
            [
                f"{what} would use {address or 'no address'!r}: multi-node ports are "
                "unauthenticated and must bind the node's private (fabric or management) "
                "address: set the agent's LLMGW_ENGINE_HOST to it"
            ]
        )
    return address


def split_host_port(hostport: str) -> tuple[str, int]:
    """``"10.0.0.2:50052"`` or ``"[fd00::2]:50052"`` -> (host, port)."""
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchValidationError([f"{hostport!r} is not host:port"])
    return host.strip("[]"), int(port)
