"""Fetching one large pinned file (a script that prints figures, not a test).

    .venv/bin/python -m tests.bench.bench_fetch [--mib 2048] [--runs 2]

On loopback, against the test Hub (tests/hub_server.py, streaming the file
from disk and counting the bytes it sends), one generated file of ``--mib``
MiB pinned as ``hf://org/big/big.gguf``:

- throughput, ``--runs`` times each in turn, into a fresh directory, each a
  process of its own: the node's fetch (worker_agent/fetch ArtifactCache:
  hashed as it arrives, fsynced, renamed), ``curl -o`` and ``hf download``
  (huggingface_hub's CLI, Xet off) of the same URL. Printed: MiB/s of each
  (best run) and the ratio of ours to the better of the two (target >= 0.9).
  Ours is timed twice: the fetch inside its process (what a running agent
  spends: it imported its modules once, at start) and the whole process
  (Python's start and the imports, about 0.3 s here, included), which is
  how curl and hf are timed;
- resume: a child process fetching the file is SIGKILLed once the hub has
  sent 60 % of it; a new fetch completes it. Printed: the bytes sent again
  over the file's size (target <= 5 %).

The server and the clients share the machine's cores: only the ratios
matter.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llmgw.hub_pin import Hub, pin_hf
from llmgw.sources import HfSource
from llmgw.types import EngineKind
from tests.hub_server import HubServer
from worker_agent.fetch import ArtifactCache, ArtifactSpec, FetchPolicy
from worker_agent.origins import Origins, artifact_for

MIB = 2**20
REPO = "org/big"
NAME = "big.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]
POLICY = FetchPolicy(disk_margin_bytes=0)


def _generate(path: Path, mib: int) -> None:
    with path.open("wb") as out:
        for _ in range(mib):
            out.write(os.urandom(MIB))


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _child_arg(spec: ArtifactSpec, into: Path) -> str:
    (f,) = spec.files
    return json.dumps({"root": str(into), "files": [[f.url, f.rel_path, f.size, f.digest]]})


def _ours(spec: ArtifactSpec, into: Path) -> float:
    """The fetch's own seconds, timed in the child."""
    # In a process of its own, as curl and hf are: the hub's thread here would
    # share this process's GIL with the fetch.
    child = subprocess.run(
        [sys.executable, "-m", "tests.bench.bench_fetch_child", _child_arg(spec, into)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(child.stdout)["fetch_s"])


def _curl(url: str, into: Path) -> None:
    into.mkdir(parents=True)
    subprocess.run(["curl", "-sSf", "-o", str(into / NAME), url], check=True)


def _hf(hub: HubServer, into: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": str(into / "home")}
    hf = Path(sys.executable).with_name("hf")
    subprocess.run(
        [str(hf), "download", REPO, NAME, "--local-dir", str(into / "out")],
        check=True,
        env=env,
        capture_output=True,
    )


def _resume(hub: HubServer, spec: ArtifactSpec, size: int, into: Path) -> float:
    """Bytes sent again after a SIGKILL at 60 %, over the file's size."""
    before = hub.served_bytes
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.fetch_server", "child", _child_arg(spec, into)],
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
    )
    try:
        while hub.served_bytes - before < 0.6 * size:
            if child.poll() is not None:
                raise RuntimeError("the child ended before 60 %")
            time.sleep(0.001)  # polling a counter another thread moves
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
    ArtifactCache(into, policy=POLICY).fetch(spec)
    return (hub.served_bytes - before - size) / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp_dir:
        tmp = Path(tmp_dir)
        source = tmp / NAME
        _generate(source, args.mib)
        size = source.stat().st_size
        hub = HubServer()
        hub.commit(REPO, {NAME: source})
        with hub.running():
            pin = pin_hf(HfSource(REPO, None, NAME), EngineKind.LLAMA_CPP, None, [], Hub(hub.url))
            spec = artifact_for(f"hf://{REPO}/{NAME}", pin, Origins(hub.url)).spec
            url = spec.files[0].url
            best: dict[str, float] = {}
            fetch_s: list[float] = []
            for run in range(args.runs):
                ways: dict[str, Callable[[Path], None]] = {
                    "llmgw": lambda into: fetch_s.append(_ours(spec, into)),
                    "curl": lambda into: _curl(url, into),
                    "hf download": lambda into: _hf(hub, into),
                }
                for name, way in ways.items():
                    into = tmp / f"{name.replace(' ', '-')}-{run}"
                    seconds = _timed(lambda: way(into))  # noqa: B023 - called at once
                    best[name] = min(best.get(name, seconds), seconds)
                    shutil.rmtree(into)
            best = {"llmgw (in agent)": min(fetch_s), "llmgw (process)": best.pop("llmgw"), **best}
            print(f"one file of {args.mib} MiB on loopback, best of {args.runs}:")
            for name, seconds in best.items():
                print(f"  {name:17s} {size / MIB / seconds:8.0f} MiB/s ({seconds:.2f} s)")
            other = min(best["curl"], best["hf download"])
            for name in ("llmgw (in agent)", "llmgw (process)"):
                print(f"  {name} / the better of curl and hf download: {other / best[name]:.2f}")
            again = _resume(hub, spec, size, tmp / "resume")
            print(f"SIGKILL at 60 %, then resumed: {again * 100:.2f} % of the file sent again")


if __name__ == "__main__":
    main()
