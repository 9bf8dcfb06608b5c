"""Router error mapping in process (ASGI): every failure is OpenAI-shaped."""

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from llmgw.store import Store
from llmgw.types import ModelSpec, ReplicaMemo, ReplicaPhase
from router.app import create_app
from tests.gateway_util import serving


class FakeSource:
    """Replicas as a test says they are."""

    def __init__(self, replicas: list[ReplicaMemo]) -> None:
        self.items = replicas

    async def replicas(self) -> list[ReplicaMemo]:
        return self.items


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    store.put_model(ModelSpec(name="catalogued", source="/m.gguf"))
    key = store.create_api_key("t")
    source = FakeSource(
        [ReplicaMemo(replica_id="r-load", model="loading-model", phase=ReplicaPhase.LOADING)]
    )
    app = create_app(store, source, refresh_interval_s=0.05)
    async with serving(app) as http:
        yield http, key


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_missing_key_401(setup: tuple[httpx.AsyncClient, str]) -> None:
    http, _ = setup
    r = await http.post("/v1/completions", json={"model": "catalogued", "prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


async def test_invalid_json_400(setup: tuple[httpx.AsyncClient, str]) -> None:
    http, key = setup
    r = await http.post("/v1/completions", content=b"{nope", headers=_auth(key))
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_missing_model_400(setup: tuple[httpx.AsyncClient, str]) -> None:
    http, key = setup
    r = await http.post("/v1/completions", json={"prompt": "x"}, headers=_auth(key))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"


async def test_unknown_model_404(setup: tuple[httpx.AsyncClient, str]) -> None:
    http, key = setup
    r = await http.post(
        "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=_auth(key)
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", ["catalogued", "loading-model"])
async def test_known_model_without_ready_replica_503(
    setup: tuple[httpx.AsyncClient, str], model: str
) -> None:
    http, key = setup
    r = await http.post("/v1/completions", json={"model": model, "prompt": "x"}, headers=_auth(key))
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "no_ready_replica"


async def test_unknown_route_is_openai_shaped(setup: tuple[httpx.AsyncClient, str]) -> None:
    http, key = setup
    r = await http.get("/v1/nothing", headers=_auth(key))
    assert r.status_code == 404
    assert "error" in r.json()
