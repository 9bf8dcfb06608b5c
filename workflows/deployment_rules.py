"""A deployment's decisions, as pure functions: when to restart, when to give up."""

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


def slots_to_retire(slots: list[Slot], desired: int) -> list[Slot]:
    """Which live slots to drain when scaling down: the newest first.

    The router's in-flight counts are not in workflow state, so "least
    loaded" is approximated by "most recently started", which has had the
    least time to build up long-running streams.
    """
    live = [s for s in slots if not s.reaped]
    excess = len(live) - desired
    if excess <= 0:
        return []
    return sorted(live, key=lambda s: s.slot, reverse=True)[:excess]
