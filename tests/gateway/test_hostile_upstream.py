"""The router's relayed inference path reads an engine as an untrusted byte
source (issue 34 §3): the hostile engine of tests/agent/test_hostile_engine.py
(a stacked gzip bomb, an endless body) behind the node's real pass-through,
in front of the whole router app, with each of its engine clients (RawUpstream,
the default, and AiohttpUpstream).

An engine is asked for identity; an encoded answer, streamed or not, is a 502
in OpenAI's format and never expanded (tracemalloc's peak: the expansion
would be one synchronous call of hundreds of MiB); a non-streamed answer that
never ends is cut at the client's cap (MAX_ANSWER_BYTES). The router's own
reads of an engine (the lost-node probe, slot priming) ask for identity and
read no further than their caps.
"""

import tracemalloc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import httpx
import pytest

from llmgw.engine_keys import engine_key
from llmgw.store import Store
from router.api.apikeys import create_key
from router.app import create_app
from router.billing.key_policy import KeyPolicy
from router.control_link.routing import Route
from router.forwarding.health import HttpProbe
from router.forwarding.slot_priming import SlotPrimer
from router.forwarding.upstream import MAX_ANSWER_BYTES, AiohttpUpstream, Upstream
from router.forwarding.upstream_raw import RawUpstream
from tests.agent import test_passthrough
from tests.agent.test_hostile_engine import (
    ENDLESS_BOUND,
    ENDLESS_STOP,
    HANG_GUARD_S,
    PEAK_BOUND,
    Engine,
    behind_passthrough,
)
from tests.gateway_util import FakeSource, auth, ready, serving, spec

M = "m1"
REPLICA = "r1"
CLIENTS: dict[str, Callable[[], Upstream]] = {
    "raw": lambda: RawUpstream(connect_timeout_s=5, read_timeout_s=HANG_GUARD_S, max_connections=4),
    "aiohttp": lambda: AiohttpUpstream(
        connect_timeout_s=5, read_timeout_s=HANG_GUARD_S, max_connections=4
    ),
}


@pytest.fixture(params=sorted(CLIENTS))
def client(request: pytest.FixtureRequest) -> Callable[[], Upstream]:
    return CLIENTS[cast(str, request.param)]


@asynccontextmanager
async def routed(
    tmp_path: Path, mode: str, make: Callable[[], Upstream], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Engine, httpx.AsyncClient, str]]:
    """A router whose one replica is a hostile engine behind its pass-through:
    what the engine saw, a client of the router, and a client key."""
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(spec(M))
    _, key = create_key(store, "k", KeyPolicy())
    # The pass-through requires the key the router derives for the replica
    # (the helper's front() checks test_passthrough.KEY).
    monkeypatch.setattr(test_passthrough, "KEY", engine_key(store.engine_key_secret(), REPLICA))
    try:
        async with behind_passthrough(mode) as (seen, endpoint):
            app = create_app(
                store,
                FakeSource([ready(REPLICA, M, endpoint)]),
                refresh_interval_s=0.05,
                http=make(),
            )
            async with serving(app) as http:
                yield seen, http, key
    finally:
        store.close()


def chat(stream: bool) -> dict[str, object]:
    return {"model": M, "messages": [{"role": "user", "content": "hi"}], "stream": stream}


def assert_upstream_failed(r: httpx.Response) -> None:
    assert r.status_code == 502, r.text[:200]
    error = r.json()["error"]
    assert error["code"] == "upstream_error" and f"`{M}`" in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
async def test_an_encoded_answer_is_a_502_never_expanded(
    tmp_path: Path,
    client: Callable[[], Upstream],
    stream: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with routed(tmp_path, "bomb", client, monkeypatch) as (seen, http, key):
        tracemalloc.start()
        try:
            r = await http.post(
                "/v1/chat/completions", json=chat(stream), headers=auth(key), timeout=HANG_GUARD_S
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert_upstream_failed(r)
    assert peak < PEAK_BOUND, f"{peak >> 20} MiB allocated: the bomb was expanded"
    assert seen.accept_encodings == [b"identity"]


async def test_an_endless_answer_is_cut_at_the_cap(
    tmp_path: Path, client: Callable[[], Upstream], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert MAX_ANSWER_BYTES < ENDLESS_STOP  # else the engine would end first
    async with routed(tmp_path, "endless", client, monkeypatch) as (seen, http, key):
        r = await http.post(
            "/v1/chat/completions", json=chat(False), headers=auth(key), timeout=HANG_GUARD_S
        )
    assert_upstream_failed(r)
    # The cap plus what the sockets and the pass-through held on the way.
    assert seen.sent < ENDLESS_STOP, seen.sent
    assert seen.accept_encodings == [b"identity"]


async def test_the_lost_node_probe_asks_for_identity() -> None:
    probe = HttpProbe(engine_key=lambda _: test_passthrough.KEY, timeout_s=HANG_GUARD_S)
    try:
        async with behind_passthrough("bomb") as (seen, endpoint):
            # Any answer but a gateway error counts: only its status is read.
            assert await probe.answers(Route(REPLICA, M, endpoint))
    finally:
        await probe.aclose()
    assert seen.accept_encodings == [b"identity"]


async def test_slot_priming_reads_no_more_than_a_slot_action_answers(
    client: Callable[[], Upstream],
) -> None:
    up = client()
    # Bounded by size here, not by its time bound.
    primer = SlotPrimer(up, timeout_s=HANG_GUARD_S)
    headers = {"Authorization": f"Bearer {test_passthrough.KEY}", "Accept-Encoding": "identity"}
    try:
        async with behind_passthrough("endless") as (seen, endpoint):
            assert not await primer.prime(REPLICA, endpoint, headers, donor=0, target=1)
    finally:
        await up.aclose()
    assert seen.paths == [b"/slots/0?action=save"]
    assert seen.sent < ENDLESS_BOUND, seen.sent
