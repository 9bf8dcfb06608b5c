"""SGLang: ``python -m sglang.launch_server``, single node or multi-node tensor parallel.

Checked against (see ``CHECKED_AGAINST``):

* ``python/sglang/srt/server_args.py`` (sgl-project/sglang main, 0.5.x): the
  primary flags are ``--tp-size`` (alias ``--tensor-parallel-size``; the
  ``--tp`` in the docs' examples only works as an argparse abbreviation) and
  ``--pp-size``; ``--dist-init-addr host:port`` (alias ``--nccl-init-addr``),
  ``--nnodes``, ``--node-rank``, ``--model-path``, ``--served-model-name``,
  ``--host``, ``--port``; ``--api-key`` exists only as an argument.
* docs.sglang.io references/multi_node_deployment: every node runs
  launch_server with the same ``--tp``, ``--dist-init-addr`` of node 0, its
  own ``--node-rank``; only node 0 serves HTTP.

The key is on argv because SGLang takes it nowhere else: the plan marks its
position so every logged or stored command line hides it, and only the
serving rank gets it.
"""

from collections.abc import Mapping

from worker_agent.adapters.base import EnvHook, leader_endpoint, require_rendezvous, start_env
from worker_agent.adapters.nccl import fabric_env, gpu_env
from worker_agent.adapters.spec import (
    CommandSpec,
    Endpoint,
    Launchers,
    LaunchValidationError,
    ReadyProbe,
    ShardPlan,
    ShardRequest,
)


class SglangAdapter:
    """Plans SGLang shards. ``launchers.sglang`` is the launch_server prefix."""

    def __init__(self, launchers: Launchers | None = None, env_hook: EnvHook | None = None) -> None:
        self._launch = launchers or Launchers()
        self._env_hook = env_hook

    def plan(self, request: ShardRequest, key: str, base_env: Mapping[str, str]) -> ShardPlan:
        """SGLang's command and environment for ``request``'s rank."""
        if request.loras or request.profile.runtime_lora:
            raise LaunchValidationError(
                ["LoRA adapters are not wired up for SGLang in llmgw: use vLLM or llama.cpp"]
            )
        node, profile = request.node, request.profile
        env = start_env(base_env, self._env_hook) | gpu_env(node.gpu_indices)
        argv = [*self._launch.sglang, "--model-path", request.model.source]
        argv += ["--tp-size", str(profile.tp)]
        if profile.pp > 1:
            argv += ["--pp-size", str(profile.pp)]
        if profile.dtype:
            argv += ["--dtype", profile.dtype]
        if profile.quantization:
            argv += ["--quantization", profile.quantization]
        wait_for: tuple[Endpoint, ...] = ()
        if request.multi_node:
            env |= fabric_env(node, allow_tcp=profile.allow_tcp)
            rdv = require_rendezvous(request)
            init = leader_endpoint(rdv, rdv.leader_port)
            argv += ["--nnodes", str(profile.nodes), "--node-rank", str(request.rank)]
            argv += ["--dist-init-addr", f"{_host_for_url(init.host)}:{init.port}"]
            if not request.leader:
                # Node 0 holds the init point; a worker started first finds nothing.
                wait_for = (init,)
        # Every rank gets a port it owns: SGLang derives internal ports from it.
        argv += ["--host", node.http_bind, "--port", str(node.http_port)]
        secret: tuple[int, ...] = ()
        if request.leader:
            argv += ["--served-model-name", request.model.name]
            if key:
                argv += ["--api-key", key]
                secret = (len(argv) - 1,)
        argv += [*request.model.engine_args, *profile.engine_args]
        command = CommandSpec(
            name="sglang", argv=tuple(argv), wait_for=wait_for, secret_argv_indices=secret
        )
        return ShardPlan(
            commands=(command,),
            env=env,
            serves_http=request.leader,
            http_port=node.http_port if request.leader else None,
            ready_probe=ReadyProbe() if request.leader else None,
        )


def _host_for_url(host: str) -> str:
    """IPv6 literals need brackets in host:port."""
    return f"[{host}]" if ":" in host else host
