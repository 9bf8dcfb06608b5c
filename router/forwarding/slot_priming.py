"""Priming a pinned llama.cpp slot with a system prompt another slot holds.

Why: with ``routing.slots`` each slot is its own cache, and llama.cpp shares
no prefix between slots, so a conversation's first turn in a slot that never
held its system prompt computes it whole: in bench_prefix W1 (16
conversations sharing a ~1,000-token system prompt) that was half of all the
prefill left with slots pinned, and what kept it from 3x fewer than
least-loaded. The server saves a slot's cache to a file and restores it into
another slot (``/slots/N?action=save|restore``, in the directory the agent
gives it with ``--slot-save-path``), a few milliseconds each for a
2,700-token slot of the bench model. So before a conversation's request goes
to a slot that does not hold its head (router/affinity/slots.py says which,
and which idle slot of the replica does), the router copies that slot into
it; llama.cpp keeps the prefix the copy shares with the prompt (the head)
and computes the rest, as with any cached prompt. Correctness never depends
on it: the engine compares tokens, so a wrong or stale copy is a miss.

Priming is bounded (``PRIME_TIMEOUT_S``): a donor or target slot busy with
another router's request makes the engine defer the action, and the request
then goes as it would have, unprimed (a deferred save still runs later: it
only rewrites the file; a restore is sent only after its save answered).
One file per replica, overwritten: disk holds at most one slot's cache. One
priming at a time per replica in a router, so its own never interleave;
another router's may, between a save and its restore: the restore then
brings that router's donor, a miss at worst. An engine that cannot save
slots (started without ``--slot-save-path``: by an older agent, or by hand)
answers 501; it is not asked again for ``UNSUPPORTED_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from llmgw.errors import UpstreamError
from router.forwarding.upstream import Upstream, UpstreamResponse

log = logging.getLogger(__name__)

# The file the engine writes the donor slot to, in its --slot-save-path.
PRIME_FILE = "llmgw-prime.bin"
# Longest a request waits on priming before it goes unprimed: a save or
# restore takes milliseconds unless the engine defers it behind a busy slot.
PRIME_TIMEOUT_S = 0.5
# Replicas' locks kept (cleared past this: replicas come and go).
MAX_LOCKS = 10_000
# How long an engine that cannot save slots is left unasked: a restarted
# replica (a newer agent's flags) keeps its id.
UNSUPPORTED_S = 600.0
# llama-server's answer to a slot action without --slot-save-path.
_NOT_IMPLEMENTED = 501
_BODY = b'{"filename":"%s"}' % PRIME_FILE.encode()
# The most of a slot action's answer read: llama-server answers a few hundred
# bytes of JSON (slot id, file, token count, timings); more is a broken or
# hostile engine, cut off (the time bound alone lets a fast one send gigabytes).
MAX_ACTION_ANSWER_BYTES = 64 * 1024


class SlotPrimer:
    """Copies one llama.cpp slot into another of the same server."""

    def __init__(
        self,
        http: Upstream,
        timeout_s: float = PRIME_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._http = http
        self._timeout_s = timeout_s
        self._clock = clock
        self._locks: dict[str, asyncio.Lock] = {}
        # Replicas whose engine cannot save slots, until when it is not asked.
        self._unsupported: dict[str, float] = {}

    async def prime(
        self, replica_id: str, endpoint: str, headers: Mapping[str, str], donor: int, target: int
    ) -> bool:
        """Copy slot ``donor`` of the engine at ``endpoint`` into slot
        ``target``; whether it was done within the bound."""
        if self._unsupported.get(replica_id, float("-inf")) > self._clock():
            return False
        lock = self._locks.get(replica_id)
        if lock is None:
            if len(self._locks) >= MAX_LOCKS:
                self._locks.clear()
            lock = self._locks[replica_id] = asyncio.Lock()
        try:
            async with asyncio.timeout(self._timeout_s), lock:
                for action, slot in (("save", donor), ("restore", target)):
                    url = f"{endpoint}/slots/{slot}?action={action}"
                    response = await self._http.post(url, _BODY, headers)
                    try:
                        await _read_small(response)
                    finally:
                        response.close()
                    if response.status == _NOT_IMPLEMENTED:
                        if len(self._unsupported) >= MAX_LOCKS:
                            self._unsupported.clear()
                        self._unsupported[replica_id] = self._clock() + UNSUPPORTED_S
                        log.info(
                            "replica %s cannot save slots: not primed for %.0f s",
                            replica_id, UNSUPPORTED_S,
                        )  # fmt: skip
                        return False
                    if response.status != 200:
                        log.info(
                            "replica %s: slot %s %s answered %s: not primed",
                            replica_id, slot, action, response.status,
                        )  # fmt: skip
                        return False
        except TimeoutError:
            log.info("replica %s: priming slot %s from %s timed out", replica_id, target, donor)
            return False
        except UpstreamError as exc:
            log.info("replica %s: priming slot %s failed: %s", replica_id, target, exc)
            return False
        return True


async def _read_small(response: UpstreamResponse) -> None:
    """Read a slot action's answer to its end (its status is all that counts),
    refusing one past ``MAX_ACTION_ANSWER_BYTES``."""
    held = 0
    async for chunk in response.chunks():
        held += len(chunk)
        if held > MAX_ACTION_ANSWER_BYTES:
            raise UpstreamError(
                f"a slot action's answer longer than {MAX_ACTION_ANSWER_BYTES} bytes"
            )
