"""schemathesis (its own runner, as ``schemathesis run`` is used from
outside) against the real router app, served by uvicorn on loopback, over
``/admin`` (the admin key) and ``/v1`` (a client key): every check but
positive data acceptance (a valid-by-schema body naming an unknown model or
file is rightly refused), its coverage phase (boundary values and every
schema violation of each field, systematically: a string for an integer, a
control character in a name), a bounded fuzzing phase and the stateful phase
(links between operations). It must find nothing (issue 34: schemathesis had
found a string taken for ``token_budget``, a revoked key patchable with 200
and names with NUL).

Bounded: a few examples per operation, derandomized, and a deadline for each
run (a router of its own each). The operations that need Temporal (503
here, documented) are left out (tests/gateway/test_router_fuzz.py checks
them against the description).
"""

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from llmgw_cli.procs import wait_for
from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.gateway_util import ADMIN_KEY, FakeSource, MockEngine, MockUpstream, ready, spec
from tests.harness import free_port, port_open

# Examples per operation and phase; the run's own bound (seconds).
MAX_EXAMPLES = 5
RUN_S = 30
# Without Temporal these answer 503.
EXCLUDED = "^/admin/nodes$|^/admin/models/\\{name\\}/scale$|^/admin/replicas/\\{replica_id\\}/logs$"


@dataclass
class _Served:
    root: str
    key: str


@pytest.fixture
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Served]:
    """A router of its own per run (the admin run deletes keys and models)."""
    from llmgw.store import Store  # noqa: PLC0415
    from router.app import create_app  # noqa: PLC0415

    db = tmp_path_factory.mktemp("schemathesis") / "s.db"
    store = Store(f"sqlite:///{db}")
    store.migrate()
    store.put_model(spec("m1"))
    _, key = create_key(store, "schemathesis", KeyPolicy())
    app = create_app(
        store,
        FakeSource([ready("r1", "m1", "http://e1:1")]),
        refresh_interval_s=0.05,
        http=MockUpstream(MockEngine()),
        admin_key=ADMIN_KEY,
        max_request_bytes=64 * 1024,
    )
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    assert wait_for(lambda: port_open(port), 30)
    yield _Served(f"http://127.0.0.1:{port}", key)
    server.should_exit = True
    thread.join(10)
    store.close()


def schemathesis_run(served: _Served, paths: str, key: str, tmp: Path) -> tuple[int, str]:
    """One ``schemathesis run`` over the operations whose path matches
    ``paths``; its exit status and output."""
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "run", f"{served.root}/openapi.json",
        "--include-path-regex", paths, "--exclude-path-regex", EXCLUDED,
        "-H", f"Authorization: Bearer {key}",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", str(MAX_EXAMPLES), "--generation-deterministic", "--seed", "1",
        "--max-time", str(RUN_S), "--workers", "1", "--request-timeout", "10",
        "--no-color", "--output-truncate", "true", "--warnings", "off",
    ]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_S + 30, cwd=tmp, env=env, check=False
    )
    return done.returncode, done.stdout + done.stderr


def test_schemathesis_finds_nothing_on_v1(served: _Served, tmp_path: Path) -> None:
    status, output = schemathesis_run(served, "^/v1/", served.key, tmp_path)
    assert status == 0, output[-6000:]


def test_schemathesis_finds_nothing_on_admin(served: _Served, tmp_path: Path) -> None:
    status, output = schemathesis_run(served, "^/admin/", ADMIN_KEY, tmp_path)
    assert status == 0, output[-6000:]
