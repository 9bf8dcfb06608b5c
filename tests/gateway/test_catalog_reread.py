"""Issue 23 item 12: a model applied after the router's last catalog read is
served on the first request (one catalog re-read before a 404), and names
nobody applied do not make the router read its store more than once per
interval."""

import asyncio
from pathlib import Path

from tests.gateway_util import auth, gateway, ready, spec

CHAT = "/v1/chat/completions"
# Longer than any test here: only the re-read can bring what changed.
SLOW_REFRESH_S = 60.0


def chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_a_model_applied_after_the_last_read_is_served_at_once(tmp_path: Path) -> None:
    async with gateway(
        tmp_path / "s.db", [], [spec("old")], refresh_interval_s=SLOW_REFRESH_S
    ) as gw:
        _, key = gw.key()
        assert gw.source is not None
        # `model apply --deploy` returned: the entry is stored, its replica runs.
        gw.store.put_model(spec("late"))
        gw.source.items = [ready("r-late", "late", "http://e1:1")]
        r = await gw.http.post(CHAT, json=chat("late"), headers=auth(key))
        assert r.status_code == 200, r.text
        assert r.headers["x-llmgw-replica"] == "r-late"


async def test_unknown_names_reread_the_catalog_at_most_once_per_interval(
    tmp_path: Path,
) -> None:
    async with gateway(
        tmp_path / "s.db", [], [spec("old")], refresh_interval_s=SLOW_REFRESH_S
    ) as gw:
        _, key = gw.key()
        assert gw.source is not None
        table = gw.app.state.deps.table
        table.reread_interval_s = SLOW_REFRESH_S
        before = gw.source.reads
        # Many at once, then more one by one: all share one re-read.
        many = [gw.http.post(CHAT, json=chat(f"nope-{i}"), headers=auth(key)) for i in range(20)]
        answers = await asyncio.gather(*many)
        answers += [
            await gw.http.post(CHAT, json=chat(f"later-{i}"), headers=auth(key)) for i in range(20)
        ]
        assert {r.status_code for r in answers} == {404}
        assert {r.json()["error"]["code"] for r in answers} == {"model_not_found"}
        assert gw.source.reads - before == 1
        # Once the interval has passed, an unknown name reads again (once).
        table.reread_interval_s = 0.0
        r = await gw.http.post(CHAT, json=chat("nope-again"), headers=auth(key))
        assert r.status_code == 404
        assert gw.source.reads - before == 2
