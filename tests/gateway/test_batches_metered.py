"""A batch's creation is metered (issue 34): it is one request of its key's.
A key limited to one request a minute creates one batch a minute, the next
is refused with the 429 a chat request would get (and nothing is made);
each creation is counted in ``llmgw_requests`` (endpoint ``batches``). The
batch's lines reserve and are billed their own as they run (not here).

The router app served by uvicorn, called with the official openai client;
the metrics read from ``GET /metrics`` with an admin key.
"""

from pathlib import Path

import httpx
import openai
import pytest

from router.api.apikeys import create_key
from router.billing.key_policy import KeyPolicy
from tests.gateway.test_batches_api import CHAT, jsonl, line, router


def _count(metrics: str, status: str) -> float:
    wanted = f'llmgw_requests_total{{endpoint="batches",model="",status="{status}"}}'
    for row in metrics.splitlines():
        if row.startswith(wanted + " "):
            return float(row.split()[-1])
    return 0.0


async def test_creating_a_batch_takes_one_of_the_keys_requests(tmp_path: Path) -> None:
    async with router(tmp_path) as r:
        key, key_id = r.key(rpm=1)
        _, admin = create_key(r.store, "admin", KeyPolicy(admin=True))
        file_id = r.file(key_id, jsonl(line("a")))
        async with r.client(key) as client, httpx.AsyncClient(base_url=r.base) as http:
            made = await client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            )
            with pytest.raises(openai.RateLimitError) as caught:
                await client.batches.create(
                    input_file_id=file_id, endpoint=CHAT, completion_window="24h"
                )
            assert caught.value.code == "rate_limit_exceeded"
            assert caught.value.response.headers.get("retry-after")
            # Nothing made for the refused one.
            assert [b.id for b in (await client.batches.list()).data] == [made.id]
            assert r.jobs.started == [made.id]

            metrics = await http.get("/metrics", headers={"Authorization": f"Bearer {admin}"})
            assert metrics.status_code == 200, metrics.text
            assert _count(metrics.text, "200") == 1
            assert _count(metrics.text, "429") == 1

        # A key without a quota creates batches as before.
        free, free_id = r.key()
        async with r.client(free) as client:
            other = r.file(free_id, jsonl(line("b")))
            for _ in range(3):
                await client.batches.create(
                    input_file_id=other, endpoint=CHAT, completion_window="24h"
                )
