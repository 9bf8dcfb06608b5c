"""Engine adapters: turn a shard spec into a command and environment.

Adapters know flags and environment variables, nothing about processes, so
they are tested as data. The engine key always travels in the environment
(never argv, which every user on the node can read with ``ps``).
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from llmgw.errors import ConfigError
from llmgw.types import EngineKind, ShardSpec

# Environment variables of the agent that engines must not inherit: the
# store URL may carry a database password.
_PRIVATE_PREFIXES = ("LLMGW_",)


@dataclass(frozen=True)
class LaunchPlan:
    """How to run one shard."""

    command: list[str]
    env: dict[str, str]
    serves_http: bool = True
    health_path: str = "/health"
    # Keys that must never be written to logs or spec files.
    secret_env: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class NodeFacts:
    """What an adapter may need to know about the node it runs on."""

    host: str
    port: int
    threads: int = 0


class EngineAdapter(Protocol):
    """Builds the launch plan of one engine kind."""

    def plan(
        self, spec: ShardSpec, node: NodeFacts, key: str, base_env: Mapping[str, str]
    ) -> LaunchPlan:
        """The command and environment for ``spec`` on this node."""
        ...


def engine_base_env(agent_env: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment minus what engines must not see."""
    return {k: v for k, v in agent_env.items() if not k.startswith(_PRIVATE_PREFIXES)}


class LlamaCppAdapter:
    """llama.cpp's ``llama-server``: single node, model file on local disk."""

    def __init__(self, server: Path, env_for: "EnvHook") -> None:
        self._server = server
        self._env_for = env_for

    def plan(
        self, spec: ShardSpec, node: NodeFacts, key: str, base_env: Mapping[str, str]
    ) -> LaunchPlan:
        """``llama-server`` serving one model under its catalog name."""
        model = spec.model
        cmd = [
            str(self._server),
            "--model",
            model.source,
            "--alias",
            model.name,
            "--host",
            node.host,
            "--port",
            str(node.port),
            "--ctx-size",
            str(model.context_length),
            "--no-webui",
        ]
        if node.threads > 0:
            cmd += ["--threads", str(node.threads)]
        if spec.gpu_indices:
            cmd += ["--n-gpu-layers", "999"]
        cmd += model.engine_args
        env = self._env_for(base_env)
        env["LLAMA_API_KEY"] = key
        if spec.gpu_indices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
        return LaunchPlan(command=cmd, env=env, secret_env=frozenset({"LLAMA_API_KEY"}))


class EnvHook(Protocol):
    """Adds what an engine binary needs to run (e.g. its library path)."""

    def __call__(self, base: Mapping[str, str]) -> dict[str, str]: ...


class AdapterRegistry:
    """The adapters this node can run, by engine kind."""

    def __init__(self, adapters: Mapping[EngineKind, EngineAdapter]) -> None:
        self._adapters = dict(adapters)

    def get(self, engine: EngineKind) -> EngineAdapter:
        """The adapter for ``engine``, or a ConfigError naming what this node runs."""
        try:
            return self._adapters[engine]
        except KeyError:
            have = ", ".join(sorted(e.value for e in self._adapters)) or "none"
            raise ConfigError(
                f"engine {engine.value} is not available on this node (has: {have})"
            ) from None
