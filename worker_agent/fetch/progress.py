"""Progress of an artifact fetch, throttled for heartbeats."""

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class FetchProgress:
    """What a heartbeat says: ``rate_bps`` counts only bytes moved by this fetch
    (not those found on disk from an earlier one)."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    rate_bps: float
    source: str


ProgressSink = Callable[[FetchProgress], None]


class ProgressMeter:
    """Counts bytes and forwards a report at most once per ``interval_s``, plus
    the first and the last: a report per chunk would swamp Temporal.

    ``bytes_by_source``: the bytes received from each source (``use`` names the
    one in flight), wrong bytes discarded included: what each source sent us.
    """

    def __init__(
        self,
        sink: ProgressSink | None,
        *,
        files_total: int,
        bytes_total: int,
        source: str,
        interval_s: float,
    ) -> None:
        self._sink = sink
        self._interval_s = interval_s
        self._files_total = files_total
        self._bytes_total = bytes_total
        self._source = source
        self._started = time.monotonic()
        self._last: float | None = None
        self.files_done = 0
        self._done_bytes = 0  # of the files done
        self._current = 0  # of the file in flight
        self._moved = 0
        self.bytes_by_source: dict[str, int] = {}

    @property
    def source(self) -> str:
        return self._source

    def use(self, source: str) -> None:
        """The bytes that follow come from ``source`` (a peer's node id, the origin)."""
        self._source = source

    @property
    def bytes_done(self) -> int:
        return self._done_bytes + self._current

    def at(self, have: int, moved: int = 0) -> None:
        """The file in flight has ``have`` bytes, ``moved`` of them just received
        (bytes found on disk from an earlier fetch count, but not in the rate)."""
        self._current = have
        self._moved += moved
        if moved:
            self.bytes_by_source[self._source] = self.bytes_by_source.get(self._source, 0) + moved
        self._report(False)

    def file_done(self, size: int) -> None:
        self.files_done += 1
        self._done_bytes += size
        self._current = 0
        self._report(self.files_done == self._files_total)

    def _report(self, final: bool) -> None:
        now = time.monotonic()
        if self._sink is None:
            return
        if not final and self._last is not None and now - self._last < self._interval_s:
            return
        self._last = now
        elapsed = max(now - self._started, 1e-6)
        self._sink(
            FetchProgress(
                self.files_done,
                self._files_total,
                self.bytes_done,
                self._bytes_total,
                self._moved / elapsed,
                self._source,
            )
        )
