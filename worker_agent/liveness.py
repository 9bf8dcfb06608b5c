"""Is a running engine still serving? The decision, without processes or HTTP.

An engine's process can live on while it serves nothing: a GPU or NCCL
hang, a frozen process, or llama.cpp's task loop wedged while its HTTP
thread still answers ``/health``. The node agent's watch
(``worker_agent/shard_service.py``) asks the engine once a round
(``worker_agent/probes.py`` ``probe_liveness``: a path that goes through the
engine's work loop) and feeds each answer here; ``Liveness`` says whether the
engine is alive, suspect, or hung, by two rules:

* unanswered: the probe failed (timeout, refused, non-200) ``rounds``
  times in a row, spanning at least ``unanswered_s`` seconds;
* stalled: the engine says it has work in flight, but the progress figure
  it reports (a counter that grows while it works) has not moved for
  ``stall_s`` seconds.

A busy engine is never hung by these rules: it answers between batches, and
its progress figure moves with each batch. One answer resets the unanswered
count, so a slow answer among good ones is no evidence. A rule set to 0 is
off.
"""

from dataclasses import dataclass

# The start of a ShardExit's reason when the watch stopped a hung engine.
ENGINE_HUNG = "engine hung"


@dataclass(frozen=True)
class LivenessRules:
    """How often an engine is asked, and when one that does not serve is hung.

    ``interval_s``: between probe rounds (0: engines are not probed);
    ``timeout_s``: the most one round waits for an answer; ``rounds``:
    consecutive unanswered probes (0: the unanswered rule is off), spanning
    at least ``unanswered_s``; ``stall_s``: how long the progress figure may
    stand still with work in flight (0: off). The defaults are the agent's
    (llmgw/settings.py AgentSettings ``liveness_*``).
    """

    interval_s: float = 10.0
    timeout_s: float = 10.0
    rounds: int = 6
    unanswered_s: float = 300.0
    stall_s: float = 600.0


@dataclass(frozen=True)
class Observation:
    """One probe's outcome.

    ``answered``: the liveness path answered 200 within the probe's timeout;
    ``why``: what went wrong when not. Where the engine tells it:
    ``in_flight``, the requests it is working on, and ``progress``, a figure
    that grows while it works (None: not told).
    """

    answered: bool
    why: str = ""
    in_flight: float | None = None
    progress: float | None = None


@dataclass(frozen=True)
class Alive:
    """Answering, and moving where it has work."""

    detail: str = "alive"


@dataclass(frozen=True)
class Suspect:
    """Unanswered ``unanswered`` rounds in a row, of the ``rounds`` that make it hung."""

    unanswered: int
    rounds: int
    why: str

    @property
    def detail(self) -> str:
        """For the watch's heartbeat."""
        of = f"/{self.rounds}" if self.rounds else ""
        return f"liveness: {self.unanswered}{of} unanswered ({self.why})"


@dataclass(frozen=True)
class Hung:
    """Not serving: ``reason`` says which rule and what was seen."""

    reason: str

    @property
    def detail(self) -> str:
        """For the watch's heartbeat."""
        return self.reason


Verdict = Alive | Suspect | Hung


class Liveness:
    """One engine's liveness, fed one observation per probe round."""

    def __init__(self, rules: LivenessRules) -> None:
        self._rules = rules
        self._unanswered = 0
        self._first_unanswered: float | None = None
        # The progress figure last seen moving with work in flight, and when.
        self._progress: float | None = None
        self._still_since: float | None = None

    def observe(self, seen: Observation, at: float, asked_at: float | None = None) -> Verdict:
        """The verdict after ``seen``, answered (or given up on) at ``at``, asked
        at ``asked_at`` (default ``at``), in monotonic seconds. Unanswered
        rounds span from the first one's asking to the last one's end."""
        if not seen.answered:
            return self._unanswered_round(seen.why, at, at if asked_at is None else asked_at)
        self._unanswered = 0
        self._first_unanswered = None
        return self._answered_round(seen, at)

    def _unanswered_round(self, why: str, at: float, asked_at: float) -> Verdict:
        rules = self._rules
        self._unanswered += 1
        if self._first_unanswered is None:
            self._first_unanswered = asked_at
        span = at - self._first_unanswered
        if rules.rounds > 0 and self._unanswered >= rules.rounds and span >= rules.unanswered_s:
            return Hung(
                f"{ENGINE_HUNG}: its liveness probe went unanswered {self._unanswered} "
                f"times over {span:.0f}s (last: {why})"
            )
        return Suspect(self._unanswered, rules.rounds, why)

    def _answered_round(self, seen: Observation, at: float) -> Verdict:
        if seen.in_flight is None or seen.progress is None or seen.in_flight <= 0:
            # Idle, or the engine does not tell: nothing can stall.
            self._progress = self._still_since = None
            return Alive("idle" if seen.in_flight == 0 else "alive")
        if self._progress is None or self._still_since is None or seen.progress != self._progress:
            self._progress, self._still_since = seen.progress, at
            return Alive(f"{seen.in_flight:g} in flight")
        still = at - self._still_since
        if self._rules.stall_s > 0 and still >= self._rules.stall_s:
            return Hung(
                f"{ENGINE_HUNG}: {seen.in_flight:g} requests in flight and its progress "
                f"({seen.progress:g}) has not moved for {still:.0f}s"
            )
        return Alive(f"{seen.in_flight:g} in flight, no progress for {still:.0f}s")
