"""A ``llama-server`` for AVX2 CPUs: llama.cpp's own HTTP server, from the xllamacpp wheel.

The ``xllamacpp`` wheel on PyPI carries llama.cpp's server compiled for any
x86-64 CPU with AVX2 (AVX, AVX2, FMA, F16C, BMI2; no AVX-512), but as a Python
extension rather than a ``llama-server`` executable. This module, run by the
launcher :func:`worker_agent.installs.llamacpp.ensure_llama_cpp` writes into the
engine cache (it imports nothing but the wheel and the standard library), takes the
``llama-server`` command-line options llmgw's engine plan and catalogs use, sets
the same parameters, and serves until it is signalled: to the agent it is a
``llama-server`` (same HTTP API, same C++ server code, same ``LLAMA_API_KEY``).

An option it does not know is an error at start (exit 2, named on stderr), never
silently dropped; ``--rpc`` in particular is refused, as the wheel has no RPC
backend (multi-node llama.cpp needs the source build's ``ggml-rpc-server``).

Its process would show as ``python3 -s -c import sys; ...``: it retitles itself
``llama-server [<what the agent put in LLMGW_ENGINE_TITLE>] <its options>``, so
``ps`` tells which replica it serves (with ``setproctitle``, where the
interpreter can load it; else only the kernel's 15-character name).
"""

import argparse
import os
import signal
import sys
from typing import Any

API_KEY_ENV = "LLAMA_API_KEY"
# worker_agent.supervisor.TITLE_ENV (this module imports nothing of llmgw).
TITLE_ENV = "LLMGW_ENGINE_TITLE"
_PR_SET_NAME = 15
# llama-server's "--parallel -1" (its default): four slots sharing one KV cache.
AUTO_PARALLEL = 4


def parser() -> argparse.ArgumentParser:
    """The llama-server options this server understands."""
    p = argparse.ArgumentParser(prog="llama-server (portable)", allow_abbrev=False)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("-a", "--alias", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=-1)
    p.add_argument("-np", "--parallel", type=int, default=-1)
    p.add_argument("-kvu", "--kv-unified", action="store_true")
    p.add_argument("--cache-idle-slots", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("-sps", "--slot-prompt-similarity", type=float, default=None)
    p.add_argument("-cram", "--cache-ram", type=int, default=None)
    p.add_argument("--slot-save-path", default="")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", default="")  # CPU build: no layers
    p.add_argument("--lora-scaled", default="", help="PATH:SCALE,...")
    p.add_argument("--api-key", default="")
    p.add_argument("--embeddings", "--embedding", action="store_true")
    p.add_argument("--pooling", choices=["none", "mean", "cls", "last", "rank"], default="")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--no-webui", action="store_true")
    p.add_argument("--rpc", default="")
    return p


def params(args: argparse.Namespace, env: dict[str, str]) -> Any:
    """xllamacpp's ``CommonParams`` for these options (``env``: the API key)."""
    import xllamacpp  # noqa: PLC0415 - only where the portable server runs

    p = xllamacpp.CommonParams()
    p.model.path = args.model
    if args.alias:
        p.model_alias = {args.alias}
    p.hostnames = [args.host]
    p.port = args.port
    p.n_ctx = args.ctx_size
    if args.threads > 0:
        p.cpuparams.n_threads = args.threads
        p.cpuparams_batch.n_threads = args.threads
    if args.parallel > 0:
        p.n_parallel, p.kv_unified = args.parallel, args.kv_unified
    else:
        p.n_parallel, p.kv_unified = AUTO_PARALLEL, True
    # Slot and prompt-cache behaviour (docs/guides/routing.md): llama-server's
    # defaults unless given.
    if args.cache_idle_slots is not None:
        p.cache_idle_slots = args.cache_idle_slots
    if args.slot_prompt_similarity is not None:
        p.slot_prompt_similarity = args.slot_prompt_similarity
    if args.cache_ram is not None:
        p.cache_ram_mib = args.cache_ram
    if args.slot_save_path:
        # llama-server's check: it must be a directory; the server adds the
        # separator before file names.
        if not os.path.isdir(args.slot_save_path):
            raise SystemExit(f"--slot-save-path: not a directory: {args.slot_save_path}")
        p.slot_save_path = os.path.join(args.slot_save_path, "")
    adapters = []
    for item in filter(None, args.lora_scaled.split(",")):
        path, _, scale = item.rpartition(":")
        adapter = xllamacpp.CommonAdapterLoraInfo()
        adapter.path, adapter.scale = path, float(scale)
        adapters.append(adapter)
    p.lora_adapters = adapters
    key = args.api_key or env.get(API_KEY_ENV, "")
    p.api_keys = [key] if key else []
    p.embedding = args.embeddings
    if args.pooling:
        name = f"LLAMA_POOLING_TYPE_{args.pooling.upper()}"
        p.pooling_type = xllamacpp.llama_pooling_type.__members__[name]
    p.endpoint_metrics = args.metrics
    p.ui = not args.no_webui
    return p


def title(argv: list[str], env: dict[str, str]) -> str:
    """The process title: ``llama-server [ENGINE TITLE] OPTIONS``, the key never in it."""
    shown = ["<redacted>" if i and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    label = env.get(TITLE_ENV, "")
    return " ".join(["llama-server", *([f"[{label}]"] if label else []), *shown])


def set_title(text: str) -> None:
    """Show ``text`` as this process's command line (``ps``, ``pgrep -f``).

    SPT_NOENV: setproctitle then writes over the arguments only, never the
    environment area, whose ``/proc/<pid>/environ`` the agent reads for its
    engine marker (the title is cut to the original command line's length,
    which the launcher's ``-c`` code makes ample).
    """
    os.environ["SPT_NOENV"] = "1"
    try:
        import setproctitle  # noqa: PLC0415 - from the wheel's site dir, where it may be absent

        setproctitle.setproctitle(text)
    except ImportError:  # an interpreter that cannot load it: the kernel's name at least
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None).prctl(_PR_SET_NAME, b"llama-server", 0, 0, 0)


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT; 2 on options it cannot honour."""
    cli = parser()
    args = cli.parse_args(argv)
    if args.rpc:
        cli.error("--rpc: the portable llama.cpp has no RPC backend (use the source build)")
    set_title(title(sys.argv[1:] if argv is None else argv, dict(os.environ)))
    import xllamacpp  # noqa: PLC0415

    server = xllamacpp.Server(params(args, dict(os.environ)))  # returns once it listens
    print(f"portable llama-server listening on {server.listening_address}", file=sys.stderr)
    # The server's threads are C++: end the process as llama-server's stop
    # signals would, without unwinding Python around them.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main())
