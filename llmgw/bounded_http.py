"""Reading an engine's answer as an untrusted byte source (agent and router).

An engine runs weights and, with some engines, code that llmgw did not write;
whatever it answers a probe or a scrape is read as if an adversary wrote it:

* it is asked for ``Accept-Encoding: identity`` and an answer with any other
  ``Content-Encoding`` is refused unread: httpx decodes a chunk in one
  synchronous call, and a 590-byte stacked gzip body (``gzip, gzip``) expands
  to 256 MiB in that call, holding the event loop (and every heartbeat of the
  process) the while;
* raw bytes are read (``aiter_raw``: never decoded) up to a cap;
* the whole exchange, head and body, has one deadline: httpx's timeouts bound
  each read alone, and a body trickling a byte per second never trips them.

Relayed inference streams are not read here (router/forwarding/); this is
for the answers the agent and router read themselves: readiness, load and
liveness checks, metric scrapes, adapter listings.
"""

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from llmgw.errors import EngineAnswerRefused

IDENTITY = "identity"


@dataclass(frozen=True)
class Answer:
    """An engine's status and the part of its body that was read."""

    status: int
    body: bytes
    # True when the body went on past the cap and only its start was kept.
    truncated: bool = False

    def text(self) -> str:
        """The body as text (undecodable bytes replaced)."""
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError if it is not)."""
        return json.loads(self.body)


async def fetch(
    http: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    headers: dict[str, str],
    max_bytes: int,
    deadline_s: float,
    json_body: object = None,
    truncate: bool = False,
) -> Answer:
    """One request to an engine: its answer, read within ``deadline_s`` in all.

    ``max_bytes``: the most of the body read; past it the answer is refused,
    or with ``truncate`` its first ``max_bytes`` kept (enough where the
    caller needs only the start, or only the status).

    Raises:
        EngineAnswerRefused: a Content-Encoding other than identity, a body
            past ``max_bytes`` (without ``truncate``), or no whole answer
            within ``deadline_s``.
        httpx.HTTPError: the exchange itself failed (refused, reset...).
    """
    sent = httpx.Headers(headers)
    sent["Accept-Encoding"] = IDENTITY
    path = httpx.URL(url).path
    try:
        async with asyncio.timeout(deadline_s):
            async with http.stream(
                method, url, headers=sent, json=json_body, timeout=deadline_s
            ) as answer:
                _refuse_encoded(path, answer.headers)
                body = bytearray()
                async for chunk in _raw(answer):
                    room = max_bytes - len(body)
                    if len(chunk) > room:
                        if not truncate:
                            raise EngineAnswerRefused(f"{path}: more than {max_bytes} bytes")
                        body += chunk[:room]
                        return Answer(answer.status_code, bytes(body), truncated=True)
                    body += chunk
                return Answer(answer.status_code, bytes(body))
    except TimeoutError:
        raise EngineAnswerRefused(f"no answer within {deadline_s:g}s") from None


async def _raw(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes as they came, never decoded."""
    if answer.is_stream_consumed:
        # Made whole in this process (httpx.MockTransport's answers are):
        # its bytes are those it was given, nothing to decode.
        yield answer.content
        return
    async for chunk in answer.aiter_raw():
        yield chunk


def _refuse_encoded(path: str, headers: httpx.Headers) -> None:
    """Refuse an answer encoded in any way but identity (asked for identity, it
    was sent something else: a broken or a hostile engine)."""
    codings = [
        c.strip().lower() for v in headers.get_list("content-encoding") for c in v.split(",")
    ]
    refused = [c for c in codings if c not in ("", IDENTITY)]
    if refused:
        raise EngineAnswerRefused(f"{path}: Content-Encoding {', '.join(refused)} refused")
