"""A deployment's decisions, as pure functions: when to restart, when to give up."""

import math
from collections.abc import Mapping

from llmgw.types import RestartPolicy, Slot


def backoff_s(consecutive_failures: int, policy: RestartPolicy) -> float:
    """Exponential backoff before restarting a slot, capped."""
    if consecutive_failures <= 0:
        return 0.0
    return float(
        min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** (consecutive_failures - 1))
    )


def should_reap(slot: Slot, policy: RestartPolicy) -> bool:
    """A slot that keeps failing stops being restarted (restart storms help nobody)."""
    return slot.consecutive_failures >= policy.max_consecutive_failures


def slots_to_retire(
    slots: list[Slot], desired: int, loads: Mapping[int, float | None] | None = None
) -> list[Slot]:
    """Which live slots to drain when scaling down: the least loaded.

    A reaped slot goes first (nothing runs there), then a replica not
    serving yet (it carries nothing); then the one
    with the fewest requests in flight, as its engine reported (``loads`` by
    slot); a replica whose load is unknown counts as busy. Ties go to the
    newest, which has had the least time to build up long-running streams.
    """
    excess = len(slots) - desired
    if excess <= 0:
        return []
    known = loads or {}

    def cost(slot: Slot) -> tuple[int, int, float, int]:
        load = known.get(slot.slot)
        return (
            int(not slot.reaped),
            int(slot.ready),
            math.inf if load is None else load,
            -slot.slot,
        )

    return sorted(slots, key=cost)[:excess]
