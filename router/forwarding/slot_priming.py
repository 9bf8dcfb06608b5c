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
then goes as it would have, unprimed. One file per replica (overwritten:
disk holds at most one slot's cache), and one priming at a time per replica
in a router, so two never interleave their save and restore.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from llmgw.errors import UpstreamError
from router.forwarding.upstream import Upstream

log = logging.getLogger(__name__)

# The file the engine writes the donor slot to, in its --slot-save-path.
PRIME_FILE = "llmgw-prime.bin"
# Longest a request waits on priming before it goes unprimed: a save or
# restore takes milliseconds unless the engine defers it behind a busy slot.
PRIME_TIMEOUT_S = 0.5
# Replicas' locks kept (cleared past this: replicas come and go).
MAX_LOCKS = 10_000
_BODY = b'{"filename":"%s"}' % PRIME_FILE.encode()


class SlotPrimer:
    """Copies one llama.cpp slot into another of the same server."""

    def __init__(self, http: Upstream, timeout_s: float = PRIME_TIMEOUT_S) -> None:
        self._http = http
        self._timeout_s = timeout_s
        self._locks: dict[str, asyncio.Lock] = {}

    async def prime(
        self, replica_id: str, endpoint: str, headers: Mapping[str, str], donor: int, target: int
    ) -> bool:
        """Copy slot ``donor`` of the engine at ``endpoint`` into slot
        ``target``; whether it was done within the bound."""
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
                        await response.read()
                    finally:
                        response.close()
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
