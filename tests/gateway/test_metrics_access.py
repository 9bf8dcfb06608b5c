"""The router's /metrics names every model and replica: it answers only the
admin credential (LLMGW_ADMIN_KEY or a stored admin key), as /admin does."""

from pathlib import Path

from tests.gateway_util import ADMIN_KEY, auth, gateway, ready, spec

M = "m1"


async def test_metrics_need_the_admin_credential(tmp_path: Path) -> None:
    async with gateway(tmp_path / "s.db", [ready("r1", M, "http://e1:1")], [spec(M)]) as gw:
        _, client_key = gw.key()
        for headers in ({}, auth(client_key), auth("sk-llmgw-nope")):
            r = await gw.http.get("/metrics", headers=headers)
            assert r.status_code == 401, headers
            assert "error" in r.json()
            assert M not in r.text and "r1" not in r.text
        r = await gw.http.get("/metrics", headers=auth(ADMIN_KEY))
        assert r.status_code == 200
        assert f'llmgw_replica_inflight{{model="{M}",replica="r1"}} 0.0' in r.text
        # A stored admin key opens it too.
        _, admin_key = gw.key(admin=True)
        assert (await gw.http.get("/metrics", headers=auth(admin_key))).status_code == 200
