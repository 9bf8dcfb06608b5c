"""Routing only to endpoints that proved they hold their replica's engine key.

A Replica memo is written by whoever can start a workflow (under ``llmgw up``
any local user can: the dev server is unauthenticated on loopback). The
registered-node check keeps an endpoint on a registered node's address, but
any process there can listen on a port; routed to, it would get client prompts
and the replica's engine key. So a memo's endpoint is routed to only once it
answered the endpoint proof (llmgw/endpoint_proof.py) for that replica: a
nonce goes to it, no key and no prompt, and the answer must be the MAC only
the holder of the replica's key, listening on that very address, can make.
The address must be an IP literal: the pass-through MACs the name it was
told to listen on, and a host name may resolve, for the router, to another
address, where a relay would pass the proof on (refused, with a log line).

:class:`ProvenSource` wraps the Temporal replica source. Proofs run as tasks
of their own, started by a refresh and awaited by none (an endpoint that never
answers holds nothing back), and never by a request. A replica is proven
while it loads, so it is routable the moment it is ready. When a proof
changes what is proven, the table is rebuilt at once from the memos already
held (``on_change``; no new listing), so a new replica waits a round trip,
not an interval. Only the first listing waits for its proofs (at most
``first_wait_s``): a starting router is not ready before the replicas that
are. A proof is cached per (replica, endpoint) and made again about every
``reprove_s`` (jittered) while the pair is listed (the port may have changed
hands); a failed one is retried after a backoff that doubles up to
``retry_max_s`` (a few seconds for a pair proven before). A proven pair
whose re-proof goes unanswered is retried quickly twice before it is left
out; a connection the proxy or the lost-node probe could not make, or that
was reset, drops the proof at once, and the pair is proven again before it
is routed. Proofs take turns: at most ``max_concurrent`` at once and
``per_host`` per host, first proofs ahead of re-proofs, so endpoints that
never answer cannot hold back real replicas.
"""

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from llmgw import endpoint_proof
from llmgw.bounded_http import IDENTITY
from llmgw.types import ROUTABLE_PHASES, ReplicaMemo, ReplicaPhase
from router.control_link.routing import CountedSource, ReplicaSource

log = logging.getLogger(__name__)

# A pass-through answers in well under a millisecond: a second is plenty,
# and a mute endpoint holds a slot no longer.
PROOF_TIMEOUT_S = 1.0
MAX_ANSWER_BYTES = 4096
REPROVE_S = 60.0
REPROVE_JITTER = 0.2  # re-proofs spread over +-20 %: never all at once
RETRY_S = 1.0
RETRY_MAX_S = 30.0
# A pair proven before (a replica that served) is retried this often at most.
RETRY_PROVEN_MAX_S = 4.0
# Unanswered re-proofs of a proven pair retried this soon, this many times,
# before it is left out (a busy moment is not a port that changed hands).
QUICK_RETRY_S = 1.0
QUICK_RETRIES = 2
# Proofs under way at once: a flood of forged memos costs a bounded number of
# sockets, and the endpoints of one host cannot take every slot.
MAX_CONCURRENT = 32
PER_HOST = 4
# Phases whose endpoint is proven: those routed to, and loading (proven by
# the time the replica is ready, not a round trip after).
PROVEN_PHASES = ROUTABLE_PHASES | {ReplicaPhase.LOADING}

Pair = tuple[str, str]  # (replica id, endpoint)


class Verdict(StrEnum):
    """What a proof came to."""

    PROVEN = "proven"
    UNANSWERED = "unanswered"  # no connection, or no answer in time
    WRONG = "wrong"  # an answer, not the replica's proof
    OUTDATED = "outdated"  # 401 at the proof path: a pass-through older than proofs
    NOT_IP = "not-ip"  # the endpoint names a host, not an IP address


_WHY = {  # why a pair is not routed, logged once per kind
    Verdict.UNANSWERED: "endpoint {endpoint} did not answer the endpoint proof",
    Verdict.WRONG: "endpoint {endpoint} did not prove it holds the replica's engine key",
    Verdict.OUTDATED: (
        "endpoint {endpoint}: pass-through predates endpoint proofs: roll the model"
        " (llmgw restart {model})"
    ),
    Verdict.NOT_IP: (
        "endpoint {endpoint} names a host, not an IP address: the proof covers the name the"
        " pass-through listens on, which may resolve elsewhere (set the agent's"
        " engine_host to an IP address)"
    ),
}


class EndpointProver(Protocol):
    """Whether an endpoint holds a replica's engine key."""

    async def prove(self, replica_id: str, endpoint: str) -> Verdict:
        """:attr:`Verdict.PROVEN` only on a valid answer; every failure is
        another verdict, never raised."""
        ...


class HttpProver:
    """Asks the endpoint's pass-through, over HTTP, for the proof of a fresh nonce."""

    def __init__(
        self, engine_key: Callable[[str], str], timeout_s: float = PROOF_TIMEOUT_S
    ) -> None:
        self._engine_key = engine_key
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            # One session, no connection kept: a connection answers one proof
            # (what answered is what is proven), and none is shared with requests.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(force_close=True),
                cookie_jar=aiohttp.DummyCookieJar(),
                # Whatever listens there is untrusted (llmgw/bounded_http.py):
                # asked for identity, and a compressed answer never expanded.
                auto_decompress=False,
                headers={"Accept-Encoding": IDENTITY},
            )
        return self._session

    async def prove(self, replica_id: str, endpoint: str) -> Verdict:
        """What ``endpoint`` answered to the proof for ``replica_id``'s key."""
        address = endpoint_proof.endpoint_address(endpoint)
        if address is None:
            return Verdict.WRONG
        if not endpoint_proof.ip_literal(urlsplit(endpoint).hostname or ""):
            return Verdict.NOT_IP  # nothing sent to a name
        nonce = secrets.token_hex(32)
        url = f"{endpoint.rstrip('/')}{endpoint_proof.PROOF_PATH}"
        try:
            async with self._open().get(
                url, params={endpoint_proof.NONCE_PARAM: nonce}, allow_redirects=False
            ) as resp:
                if resp.status == 401:  # asks for a key: a pass-through from before proofs
                    return Verdict.OUTDATED
                if resp.status != 200:
                    return Verdict.WRONG
                if resp.headers.get("Content-Encoding", "").strip().lower() not in ("", IDENTITY):
                    return Verdict.WRONG  # the pass-through never compresses
                body = await resp.content.read(MAX_ANSWER_BYTES)
        except (aiohttp.ClientError, TimeoutError, OSError):
            return Verdict.UNANSWERED
        except ValueError:
            return Verdict.WRONG
        try:
            given = json.loads(body).get("proof")
        except (ValueError, AttributeError):
            return Verdict.WRONG
        expected = endpoint_proof.answer(self._engine_key(replica_id), address, nonce)
        if isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode()):
            return Verdict.PROVEN
        return Verdict.WRONG

    async def aclose(self) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


class Slots:
    """At most ``total`` proofs at once and ``per_host`` per host; waiters go
    by rank (lower first: first proofs before re-proofs), then arrival."""

    def __init__(self, total: int = MAX_CONCURRENT, per_host: int = PER_HOST) -> None:
        self._total = total
        self._per_host = per_host
        self._running = 0
        self._by_host: Counter[str] = Counter()
        self._waiters: list[tuple[int, int, str, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        """Proofs waiting for a slot."""
        return len(self._waiters)

    def _room(self, host: str) -> bool:
        return self._running < self._total and self._by_host[host] < self._per_host

    def _take(self, host: str) -> None:
        self._running += 1
        self._by_host[host] += 1

    def _release(self, host: str) -> None:
        self._running -= 1
        self._by_host[host] -= 1
        if self._by_host[host] <= 0:
            del self._by_host[host]
        for waiter in sorted(self._waiters):  # a handful: proofs are rare
            if self._running >= self._total:
                break
            _, _, wanted, future = waiter
            if self._by_host[wanted] < self._per_host:
                self._waiters.remove(waiter)
                self._take(wanted)
                future.set_result(None)

    @contextlib.asynccontextmanager
    async def hold(self, host: str, rank: int) -> AsyncIterator[None]:
        """A slot for a proof to ``host`` while the block runs."""
        if not self._room(host):
            # Anyone waiting waits for a full host (else it had been woken):
            # a newcomer with room goes ahead without passing anyone.
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            waiter = (rank, next(self._seq), host, future)
            self._waiters.append(waiter)
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._release(host)  # granted, then cancelled before it ran
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        else:
            self._take(host)
        try:
            yield
        finally:
            self._release(host)


@dataclass
class _Proof:
    model: str
    phase: ReplicaPhase
    proven: bool = False
    ever: bool = False  # proven once: retried sooner, ranked as a re-proof
    due: float = 0.0  # when to prove (again); time.monotonic()
    backoff: float = 0.0
    misses: int = 0  # unanswered re-proofs in a row while still proven
    task: asyncio.Task[None] | None = None
    said: Verdict | None = None  # the failure last logged (each kind once)


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
        *,
        per_host: int = PER_HOST,
        retry_proven_max_s: float = RETRY_PROVEN_MAX_S,
        quick_retry_s: float = QUICK_RETRY_S,
        jitter: float = REPROVE_JITTER,
    ) -> None:
        self._inner = inner
        self._first_wait_s = first_wait_s
        self._prover = prover
        self._clock = clock
        self._reprove_s = reprove_s
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self._retry_proven_max_s = retry_proven_max_s
        self._quick_retry_s = quick_retry_s
        self._jitter = jitter
        self.slots = Slots(max_concurrent, per_host)
        self._proofs: dict[Pair, _Proof] = {}
        self._listeners: list[Callable[[], None]] = []
        self._seen: tuple[list[ReplicaMemo], int] | None = None  # what _kept was made from
        self._kept: list[ReplicaMemo] = []
        self._dirty = False
        self._next_due = math.inf
        self._closed = False
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

    def held(self) -> list[ReplicaMemo]:
        """:meth:`replicas` from the memos of the last listing, without a new
        one: what a landed proof changed (the table rebuilds from it)."""
        if self._seen is not None and (self._dirty or self._clock() >= self._next_due):
            self._update(self._seen[0])
        return self._kept

    def distrust(self, replica_id: str, endpoint: str) -> None:
        """A connection to the pair failed or was reset: not routed until it
        proves its key again (the port may have changed hands)."""
        pair = (replica_id, endpoint)
        proof = self._proofs.get(pair)
        if proof is None or not proof.proven or self._closed:
            return
        log.warning(
            "replica %s: no connection to %s: not routed until it proves its key again", *pair
        )
        proof.proven = False
        proof.misses = 0
        proof.backoff = 0.0
        proof.due = self._clock()
        if proof.task is None:
            proof.task = asyncio.create_task(self._prove(pair, proof))
        self._changed()

    async def check(self, replica_id: str, endpoint: str) -> bool:
        """Prove the pair now (the lost-node probe, before it sends the key);
        a failure drops its proof."""
        host = urlsplit(endpoint).hostname or ""
        async with self.slots.hold(host, 1):
            verdict = await self._prover.prove(replica_id, endpoint)
        if verdict is not Verdict.PROVEN:
            self.distrust(replica_id, endpoint)
        return verdict is Verdict.PROVEN

    async def aclose(self) -> None:
        """Cancel every proof under way and close the prover (router shutdown)."""
        self._closed = True
        tasks = [p.task for p in self._proofs.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        close: Any = getattr(self._prover, "aclose", None)
        if close is not None:
            await close()

    def _changed(self) -> None:
        self._dirty = True
        for listener in self._listeners:
            listener()

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
            if not memo.endpoint or memo.phase not in PROVEN_PHASES:
                kept.append(memo)
                continue
            pair = (memo.replica_id, memo.endpoint)
            listed.add(pair)
            proof = self._proofs.get(pair)
            if proof is None:
                proof = self._proofs[pair] = _Proof(memo.model, memo.phase)
            elif proof.phase != memo.phase:
                if not proof.proven:
                    proof.due = now  # loaded (or back): proven at once, not after a backoff
                proof.phase = memo.phase
            if proof.task is None and now >= proof.due and not self._closed:
                proof.task = asyncio.create_task(self._prove(pair, proof))
            if proof.task is None:
                next_due = min(next_due, proof.due)
            if proof.proven or memo.phase not in ROUTABLE_PHASES:
                kept.append(memo)  # a loading memo is shown, never routed
        for pair in self._proofs.keys() - listed:  # gone from the listing: forgotten
            task = self._proofs.pop(pair).task
            if task is not None:
                task.cancel()
        self._next_due = next_due
        return kept

    async def _prove(self, pair: Pair, proof: _Proof) -> None:
        # First proofs go ahead of re-proofs of proven pairs, and those ahead
        # of endpoints that never proved anything (forged, or mute).
        rank = 0 if proof.said is None and not proof.ever else 1 if proof.ever else 2
        host = urlsplit(pair[1]).hostname or ""
        verdict = Verdict.UNANSWERED
        try:
            async with self.slots.hold(host, rank):
                verdict = await self._prover.prove(*pair)
        except asyncio.CancelledError:
            raise  # shutdown, or the pair is gone: nothing landed
        except Exception as exc:  # a prover's bug must not end the proofs
            log.warning("endpoint proof of %s at %s failed: %r", *pair, exc)
        with contextlib.suppress(Exception):
            self._landed(pair, proof, verdict)

    def _landed(self, pair: Pair, proof: _Proof, verdict: Verdict) -> None:
        proof.task = None
        now = self._clock()
        ok = verdict is Verdict.PROVEN
        if ok:
            proof.ever = True
            proof.backoff = 0.0
            proof.misses = 0
            spread = 1 + random.uniform(-self._jitter, self._jitter)
            proof.due = now + self._reprove_s * spread
            proof.said = None
        elif proof.proven and verdict is Verdict.UNANSWERED and proof.misses < QUICK_RETRIES:
            # Still routed: a moment's silence is not a port that changed hands.
            proof.misses += 1
            proof.due = now + self._quick_retry_s
            ok = True
        else:
            cap = self._retry_proven_max_s if proof.ever else self._retry_max_s
            proof.backoff = min(max(proof.backoff * 2, self._retry_s), cap)
            proof.due = now + proof.backoff
            if proof.said is not verdict and proof.phase in ROUTABLE_PHASES:
                proof.said = verdict  # (a loading replica's pass-through may not be up)
                why = _WHY[verdict].format(endpoint=pair[1], model=proof.model)
                log.warning("replica %s not routed: %s", pair[0], why)
        self._next_due = min(self._next_due, proof.due)
        if ok != proof.proven and self._proofs.get(pair) is proof:
            proof.proven = ok
            self._changed()
