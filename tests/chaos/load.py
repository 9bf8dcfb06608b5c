"""The run's traffic: a seeded, open-loop mix through the load balancer.

Arrivals follow a Poisson process of the given rate whatever the answers
take (open loop: a slow cluster gets more requests in flight, not fewer);
each request has its own id and class: ``chat``, ``stream`` (chat,
streamed), ``completion``, ``response`` (a background Responses call,
polled to its end). A batch is submitted at the start and its lines are
checked at the end. Every outcome is kept with when it started and ended.
"""

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from tests.cluster.stack import MODEL

CLASSES = ("chat", "stream", "completion", "response")
WEIGHTS = (4, 3, 3, 1)
MAX_TOKENS = 6
# Bounds an outage's pile-up: past it an arrival is counted as shed, not sent.
MAX_IN_FLIGHT = 48
RESPONSE_WAIT_S = 300.0


@dataclass
class Outcome:
    """One client request."""

    id: str
    what: str
    started: float
    ended: float = 0.0
    ok: bool = False
    tokens: int = 0
    error: str = ""


@dataclass
class Load:
    """The traffic of a run; ``outcomes`` grows as requests end."""

    base_url: str
    keys: dict[str, str]  # request class -> the client key it is sent with
    rate_per_s: float
    rng: random.Random
    outcomes: list[Outcome] = field(default_factory=list)
    shed: int = 0
    sent: dict[str, int] = field(default_factory=dict)
    _tasks: set["asyncio.Task[None]"] = field(default_factory=set)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def _client(self, key: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(120, connect=5),
        )

    async def run(self) -> None:
        """Send until :meth:`stop`; then wait for what is in flight."""
        self._http = {what: self._client(key) for what, key in self.keys.items()}
        n = 0
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):  # the next arrival's time
                    await asyncio.wait_for(self._stop.wait(), self.rng.expovariate(self.rate_per_s))
                if self._stop.is_set():
                    break
                n += 1
                what = self.rng.choices(CLASSES, WEIGHTS)[0]
                if len(self._tasks) >= MAX_IN_FLIGHT:
                    self.shed += 1
                    continue
                self.sent[what] = self.sent.get(what, 0) + 1
                task = asyncio.create_task(self._one(f"req-{n}", what))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if self._tasks:
                await asyncio.wait(self._tasks)
        finally:
            for http in self._http.values():
                await http.aclose()

    def stop(self) -> None:
        """Send no more."""
        self._stop.set()

    async def _one(self, rid: str, what: str) -> None:
        out = Outcome(rid, what, time.monotonic())
        try:
            if what == "chat":
                out.tokens = await self._chat_once(rid)
            elif what == "stream":
                out.tokens = await self._stream_once(rid)
            elif what == "completion":
                out.tokens = await self._completion_once(rid)
            else:
                out.tokens = await self._response_once(rid)
            out.ok = True
        except Exception as exc:  # any failure is the client's outcome, counted
            out.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            out.ended = time.monotonic()
            self.outcomes.append(out)

    async def _chat_once(self, rid: str) -> int:
        r = await self._http["chat"].post(
            "/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": f"say {rid}"}],
                "max_tokens": MAX_TOKENS,
            },
        )
        _ok(r)
        return int(r.json()["usage"]["completion_tokens"])

    async def _completion_once(self, rid: str) -> int:
        r = await self._http["completion"].post(
            "/completions", json={"model": MODEL, "prompt": f"{rid}:", "max_tokens": MAX_TOKENS}
        )
        _ok(r)
        return int(r.json()["usage"]["completion_tokens"])

    async def _stream_once(self, rid: str) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"stream {rid}"}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        done, tokens = False, -1
        async with self._http["stream"].stream("POST", "/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                _ok(r)
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise ValueError(f"error event: {event['error']}")
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
        if not done or tokens < 0:
            raise ValueError("the stream ended without its usage and [DONE]")
        return tokens

    async def _response_once(self, rid: str) -> int:
        jobs = self._http["response"]
        r = await jobs.post(
            "/responses",
            json={"model": MODEL, "input": f"respond {rid}", "background": True,
                  "max_output_tokens": MAX_TOKENS},
        )  # fmt: skip
        _ok(r)
        resp_id = r.json()["id"]
        async with asyncio.timeout(RESPONSE_WAIT_S):
            while True:
                got = await jobs.get(f"/responses/{resp_id}")
                if got.status_code == 200:
                    status = got.json()["status"]
                    details = got.json().get("incomplete_details") or {}
                    # Stopped at max_output_tokens, as asked: a whole answer.
                    if status == "completed" or (
                        status == "incomplete" and details.get("reason") == "max_output_tokens"
                    ):
                        return int(got.json()["usage"]["output_tokens"])
                    if status in ("failed", "cancelled", "incomplete"):
                        raise ValueError(f"response {resp_id} ended {status}: {got.text[:200]}")
                await asyncio.sleep(0.5)


def _ok(r: httpx.Response) -> None:
    if r.status_code != 200:
        raise ValueError(f"HTTP {r.status_code}: {r.text[:200]}")


async def submit_batch(base_url: str, key: str, lines: int) -> str:
    """A batch of ``lines`` chat requests, custom ids ``line-<n>``; its id."""
    body = "".join(
        json.dumps(
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"line {n}"}],
                    "max_tokens": 4,
                },
            }
        )
        + "\n"
        for n in range(lines)
    )
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as http:
        up = await http.post(
            "/files",
            data={"purpose": "batch"},
            files={"file": ("batch.jsonl", body.encode(), "application/jsonl")},
        )
        _ok(up)
        made = await http.post(
            "/batches",
            json={
                "input_file_id": up.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        _ok(made)
        return str(made.json()["id"])


async def batch_lines(
    base_url: str, key: str, batch_id: str, timeout_s: float
) -> tuple[list[str], list[str]]:
    """The custom ids in the finished batch's output file and in its error file."""
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60
    ) as http, asyncio.timeout(timeout_s):  # fmt: skip
        while True:
            got = await http.get(f"/batches/{batch_id}")
            if got.status_code == 200 and got.json()["status"] in (
                "completed", "failed", "expired", "cancelled",
            ):  # fmt: skip
                break
            await asyncio.sleep(1)
        found: dict[str, list[str]] = {"output_file_id": [], "error_file_id": []}
        for which, ids in found.items():
            file_id = got.json().get(which)
            if file_id:
                content = await http.get(f"/files/{file_id}/content")
                _ok(content)
                ids += [json.loads(x)["custom_id"] for x in content.text.splitlines() if x]
        return found["output_file_id"], found["error_file_id"]
