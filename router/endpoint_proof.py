"""Routing only to endpoints that proved they hold their replica's engine key.

A Replica memo is written by whoever can start a workflow (under ``llmgw up``
any local user can: the dev server is unauthenticated on loopback). The
registered-node check keeps an endpoint on a registered node's address, but
any process there can listen on a port; routed to, it would get client prompts
and the replica's engine key. So a memo's endpoint is routed to only once it
answered the endpoint proof (llmgw/endpoint_proof.py) for that replica: a
nonce goes to it, no key and no prompt, and the answer must be the MAC only
the holder of the replica's key, listening on that very address, can make.

:class:`ProvenSource` wraps the Temporal replica source. Proofs run as tasks
of their own, started by a refresh and awaited by none (an endpoint that never
answers holds nothing back), and never by a request. When one changes what is
proven, the table is asked to refresh at once (``on_change``), so a new
replica waits a round trip, not an interval. Only the first listing waits
for its proofs (at most ``first_wait_s``): a starting router is not ready
before the replicas that are. A proof is cached per
(replica, endpoint) and made again every ``reprove_s`` while the pair is
listed (the port may have changed hands); a failed one is retried after a
backoff that doubles up to ``retry_max_s``.
"""

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from llmgw import endpoint_proof
from llmgw.types import ROUTABLE_PHASES, ReplicaMemo
from router.routing import CountedSource, ReplicaSource

log = logging.getLogger(__name__)

PROOF_TIMEOUT_S = 5.0
MAX_ANSWER_BYTES = 4096
REPROVE_S = 60.0
RETRY_S = 1.0
RETRY_MAX_S = 30.0
# Proofs under way at once: a flood of forged memos costs a bounded number of sockets.
MAX_CONCURRENT = 32

Pair = tuple[str, str]  # (replica id, endpoint)


class EndpointProver(Protocol):
    """Whether an endpoint holds a replica's engine key."""

    async def prove(self, replica_id: str, endpoint: str) -> bool:
        """True only on a valid answer; every failure is False, never raised."""
        ...


class HttpProver:
    """Asks the endpoint's pass-through, over HTTP, for the proof of a fresh nonce."""

    def __init__(
        self, engine_key: Callable[[str], str], timeout_s: float = PROOF_TIMEOUT_S
    ) -> None:
        self._engine_key = engine_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def prove(self, replica_id: str, endpoint: str) -> bool:
        """Whether ``endpoint`` answered the proof for ``replica_id``'s key."""
        address = endpoint_proof.endpoint_address(endpoint)
        if address is None:
            return False
        nonce = secrets.token_hex(32)
        url = f"{endpoint.rstrip('/')}{endpoint_proof.PROOF_PATH}"
        try:
            # A session a proof: proofs are rare, and none shares a pooled
            # connection with requests (what answered a proof is what is proven).
            async with (
                aiohttp.ClientSession(
                    timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar()
                ) as http,
                http.get(
                    url, params={endpoint_proof.NONCE_PARAM: nonce}, allow_redirects=False
                ) as resp,
            ):
                if resp.status != 200:
                    return False
                body = await resp.content.read(MAX_ANSWER_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return False
        try:
            given = json.loads(body).get("proof")
        except (ValueError, AttributeError):
            return False
        expected = endpoint_proof.answer(self._engine_key(replica_id), address, nonce)
        return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


@dataclass
class _Proof:
    proven: bool = False
    due: float = 0.0  # when to prove (again); time.monotonic()
    backoff: float = 0.0
    task: asyncio.Task[None] | None = None
    warned: bool = False


class ProvenSource:
    """``inner``'s replicas, less those whose endpoint has not proven its key.

    A memo outside the routable phases, or without an endpoint, passes as it
    is: nothing is sent to it.
    """

    def __init__(
        self,
        inner: ReplicaSource,
        prover: EndpointProver,
        clock: Callable[[], float] = time.monotonic,
        reprove_s: float = REPROVE_S,
        retry_s: float = RETRY_S,
        retry_max_s: float = RETRY_MAX_S,
        max_concurrent: int = MAX_CONCURRENT,
        first_wait_s: float = PROOF_TIMEOUT_S,
    ) -> None:
        self._inner = inner
        self._first_wait_s = first_wait_s
        self._prover = prover
        self._clock = clock
        self._reprove_s = reprove_s
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._proofs: dict[Pair, _Proof] = {}
        self._listeners: list[Callable[[], None]] = []
        self._seen: tuple[list[ReplicaMemo], int] | None = None  # what _kept was made from
        self._kept: list[ReplicaMemo] = []
        self._dirty = False
        self._next_due = math.inf
        self.generation = 0

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever a proof changed what is routable."""
        self._listeners.append(listener)

    def proven(self, replica_id: str, endpoint: str) -> bool:
        """Whether the pair is proven now (for tests and the admin's curiosity)."""
        proof = self._proofs.get((replica_id, endpoint))
        return proof is not None and proof.proven

    async def replicas(self) -> list[ReplicaMemo]:
        """The inner source's replicas whose endpoints are proven; proofs
        for the others are started (awaited on the first call only)."""
        memos = await self._inner.replicas()
        inner_gen = self._inner.generation if isinstance(self._inner, CountedSource) else -1
        first = self._seen is None
        if (
            self._seen is None
            or self._seen[0] is not memos
            or self._seen[1] != inner_gen
            or self._dirty
            or self._clock() >= self._next_due
        ):
            self._seen = (memos, inner_gen)
            self._update(memos)
        if first:
            # A starting router's first table (what its readiness reports) has
            # its replicas: the first proofs are waited for, within a bound.
            pending = {p.task for p in self._proofs.values() if p.task is not None}
            if pending:
                await asyncio.wait(pending, timeout=self._first_wait_s)
                self._update(memos)
        return self._kept

    def _update(self, memos: list[ReplicaMemo]) -> None:
        self._dirty = False
        kept = self._filter(memos, self._clock())
        if kept != self._kept:
            self._kept = kept
            self.generation += 1

    def _filter(self, memos: list[ReplicaMemo], now: float) -> list[ReplicaMemo]:
        kept: list[ReplicaMemo] = []
        listed: set[Pair] = set()
        next_due = math.inf
        for memo in memos:
            if not memo.endpoint or memo.phase not in ROUTABLE_PHASES:
                kept.append(memo)
                continue
            pair = (memo.replica_id, memo.endpoint)
            listed.add(pair)
            proof = self._proofs.setdefault(pair, _Proof())
            if proof.task is None and now >= proof.due:
                proof.task = asyncio.create_task(self._prove(pair, proof))
            if proof.task is None:
                next_due = min(next_due, proof.due)
            if proof.proven:
                kept.append(memo)
        for pair in self._proofs.keys() - listed:  # gone from the listing: forgotten
            task = self._proofs.pop(pair).task
            if task is not None:
                task.cancel()
        self._next_due = next_due
        return kept

    async def _prove(self, pair: Pair, proof: _Proof) -> None:
        ok = False
        try:
            async with self._slots:
                ok = await self._prover.prove(*pair)
        except Exception as exc:  # a prover's bug must not end the proofs
            log.warning("endpoint proof of %s at %s failed: %r", *pair, exc)
        finally:
            with contextlib.suppress(Exception):
                self._landed(pair, proof, ok)

    def _landed(self, pair: Pair, proof: _Proof, ok: bool) -> None:
        proof.task = None
        if ok:
            proof.backoff = 0.0
            proof.due = self._clock() + self._reprove_s
            proof.warned = False
        else:
            proof.backoff = min(max(proof.backoff * 2, self._retry_s), self._retry_max_s)
            proof.due = self._clock() + proof.backoff
            if not proof.warned:
                proof.warned = True
                log.warning(
                    "replica %s not routed: endpoint %s did not prove it holds the"
                    " replica's engine key",
                    *pair,
                )
        self._next_due = min(self._next_due, proof.due)
        if ok != proof.proven and self._proofs.get(pair) is proof:
            proof.proven = ok
            self._dirty = True
            for listener in self._listeners:
                listener()
