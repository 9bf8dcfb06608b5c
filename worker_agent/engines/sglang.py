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

SGLang takes its key nowhere but argv, and a process's argv is readable by
every local user (``ps``) and lands in spec files and logs. So the serving
rank does not exec ``python -m sglang.launch_server ... --api-key KEY``: it
execs ``python -c KEY_SHIM sglang.launch_server ...`` with the key in the
environment (``KEY_ENV``, private to the engine's user); the shim takes it out
of the environment, appends ``--api-key KEY`` to ``sys.argv`` in memory, and
runs the module as ``-m`` would. Only with a launcher that is not
``PYTHON -m MODULE`` does the key go on argv, its position marked so every
logged or stored command line hides it.
"""

from collections.abc import Mapping, Sequence

from worker_agent.engines.base import EnvHook, leader_endpoint, require_rendezvous, start_env
from worker_agent.engines.nccl import fabric_env, gpu_env
from worker_agent.engines.spec import (
    CommandSpec,
    Endpoint,
    Launchers,
    LaunchValidationError,
    ReadyProbe,
    ShardPlan,
    ShardRequest,
)

KEY_ENV = "LLMGW_SGLANG_API_KEY"
# Runs as ``python -c KEY_SHIM MODULE ARGS...``: sys.argv is then
# ["-c", MODULE, ARGS...]. run_module with alter_sys sets sys.argv[0] and
# __main__ as ``python -m MODULE`` does (multiprocessing children included).
KEY_SHIM = (
    "import os, runpy, sys; "
    f"key = os.environ.pop({KEY_ENV!r}, ''); "
    "module = sys.argv[1]; "
    "sys.argv = [module, *sys.argv[2:], *(['--api-key', key] if key else [])]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def _module_launcher(prefix: Sequence[str]) -> tuple[str, str] | None:
    """(python, module) when ``prefix`` is ``PYTHON -m MODULE``, else None."""
    if len(prefix) == 3 and prefix[1] == "-m":
        return prefix[0], prefix[2]
    return None


class SglangPlanner:
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
        # Weights come from the node's cache (the fetch step), never a hub: a
        # missing file is an error at load, not a download behind our back.
        env["HF_HUB_OFFLINE"] = "1"
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
        secret_env: tuple[str, ...] = ()
        if request.leader:
            argv += ["--served-model-name", request.model.name]
            # usage.prompt_tokens_details.cached_tokens in every answer: the
            # router's cache-aware routing corrects itself from it (off by default).
            argv += ["--enable-cache-report"]
        argv += [*request.model.engine_args, *profile.engine_args]
        if request.leader and key:
            module = _module_launcher(self._launch.sglang)
            if module is not None:
                python, name = module
                argv = [python, "-c", KEY_SHIM, name, *argv[len(self._launch.sglang) :]]
                env[KEY_ENV] = key
                secret_env = (KEY_ENV,)
            else:
                argv += ["--api-key", key]
                secret = (len(argv) - 1,)
        command = CommandSpec(
            name="sglang", argv=tuple(argv), wait_for=wait_for, secret_argv_indices=secret
        )
        return ShardPlan(
            commands=(command,),
            env=env,
            serves_http=request.leader,
            http_port=node.http_port if request.leader else None,
            ready_probe=ReadyProbe() if request.leader else None,
            secret_env=secret_env,
        )


def _host_for_url(host: str) -> str:
    """IPv6 literals need brackets in host:port."""
    return f"[{host}]" if ":" in host else host
