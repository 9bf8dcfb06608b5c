"""Metric labels come from route templates and bounded sets, never from request
text: keyless requests to made-up paths, and keyed ones naming made-up models,
add no series to the router's registry (each series is kept for good, so a
label taken from the request grew the router's memory with every request)."""

import random
import string
from pathlib import Path

from prometheus_client import CollectorRegistry

from tests.gateway_util import auth, gateway, ready, spec

M = "m1"
REQUESTS = 10_000


def _series(registry: CollectorRegistry) -> int:
    return sum(len(family.samples) for family in registry.collect())


def _text(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + "-_.~", k=rng.randint(1, 24)))


def _paths(rng: random.Random) -> list[tuple[str, str]]:
    """(method, path) under every keyed /v1 route, and outside any."""
    r = _text(rng)
    return [
        ("GET", f"/v1/files/{r}"),
        ("GET", f"/v1/files/{r}/content"),
        ("DELETE", f"/v1/files/{r}"),
        ("GET", f"/v1/responses/{r}"),
        ("GET", f"/v1/responses/{r}/input_items"),
        ("POST", f"/v1/responses/{r}/cancel"),
        ("GET", f"/v1/batches/{r}"),
        ("POST", f"/v1/batches/{r}/cancel"),
        ("GET", f"/v1/{r}"),
        ("GET", f"/{r}"),
        ("POST", f"/v1/chat/completions/{r}"),
    ]


async def test_keyless_requests_to_random_paths_add_no_series(tmp_path: Path) -> None:
    rng = random.Random(34)
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)]) as gw:
        registry = gw.app.state.deps.metrics.registry
        _, key = gw.key()

        async def one_round() -> int:
            sent = 0
            for method, path in _paths(rng):
                r = await gw.http.request(method, path)
                assert r.status_code in (401, 404, 405), (method, path, r.status_code)
                sent += 1
            for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
                assert (await gw.http.post(path, json={})).status_code == 401
                # A made-up model name is the client's text too.
                body = {"model": _text(rng), "prompt": "x", "input": "x", "messages": []}
                r = await gw.http.post(path, json=body, headers=auth(key))
                assert r.status_code in (400, 404), (path, r.status_code)
                sent += 2
            r = await gw.http.get("/v1/models")
            assert r.status_code == 401
            return sent + 1

        await one_round()  # the label sets a route and a status make, once
        before = _series(registry)
        sent = 0
        while sent < REQUESTS:
            sent += await one_round()
        assert _series(registry) == before
