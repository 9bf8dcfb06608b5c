"""llama.cpp servers of the tiny model for the router's tests: started with
one slot each, keyed as a router keys them (the engine key of their replica
id), and stopped when the block ends. Whichever llama.cpp install path the
machine chose (``llama``) serves them."""

import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from llmgw.engine_keys import engine_key
from llmgw.store import Store
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import free_port

if TYPE_CHECKING:
    from worker_agent.installs.llamacpp import LlamaCppInstall


def store_secret(store_url: str) -> str:
    """A new store's engine-key secret (migrated first): what a router on
    that store keys its requests to engines with."""
    store = Store(store_url)
    try:
        store.migrate()
        return store.engine_key_secret()
    finally:
        store.close()


def healthy(endpoint: str) -> bool:
    """Whether the server at ``endpoint`` answers its health check."""
    try:
        return httpx.get(f"{endpoint}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def llama_servers(
    llama: "LlamaCppInstall",
    tiny: TinyModel,
    root: Path,
    secret: str,
    model: str,
    replicas: Sequence[str],
    ctx_size: int,
    extra_args: Sequence[str] = (),
) -> Iterator[dict[str, str]]:
    """One server per replica id, one slot and one thread each (``extra_args``
    come last: llama.cpp takes the last value of a repeated option): replica id
    -> endpoint, once every one answers its health check (logs: ``root/<id>.log``)."""
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, str] = {}
    try:
        for replica in replicas:
            port = free_port()
            env = llama.environment(os.environ) | {"LLAMA_API_KEY": engine_key(secret, replica)}
            argv = [
                str(llama.server), "--model", str(tiny.model_path), "--alias", model,
                "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size),
                "--parallel", "1", "--threads", "1", "--no-webui", *extra_args,
            ]  # fmt: skip
            with (root / f"{replica}.log").open("wb") as out:
                procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
            endpoints[replica] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        for proc, (replica, endpoint) in zip(procs, endpoints.items(), strict=True):
            while not healthy(endpoint):
                assert proc.poll() is None, (root / f"{replica}.log").read_text()
                assert time.monotonic() < deadline, f"llama.cpp {replica} did not start"
                time.sleep(0.1)
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
