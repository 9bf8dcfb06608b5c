"""How a fetch from a remote source fails, under ``WeightsError`` (worker_agent/weights.py).

``retryable`` says whether the fetch loop (and, later, Temporal) may try again;
messages name the file and the HTTP status, never a request header: the
headers carry the source's token.
"""

from worker_agent.fetch.entry import ChecksumMismatch, WeightsError


class SourceUnavailable(WeightsError):
    """The source could not answer now: a connection error, a 5xx, a 429. Try again."""

    retryable = True

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class FetchStalled(SourceUnavailable):
    """No byte arrived for the stall window: the connection is dropped and resumed."""


class SourceRefused(WeightsError):
    """The source said no for good (401, 403, 404, 410): trying again cannot help."""

    retryable = False

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class FileMismatch(ChecksumMismatch):
    """A file's bytes are not the manifest's: its size or digest differ. The
    message names the file and both digests."""

    def __init__(self, rel_path: str, expected: str, got: str, kind: str = "sha256") -> None:
        super().__init__(f"{rel_path}: expected {kind} {expected}, got {got}")
        self.rel_path = rel_path
        self.expected = expected
        self.got = got


class DiskTooSmall(WeightsError):
    """The cache's filesystem has too little free space for what is left to fetch."""

    retryable = False

    def __init__(self, needed: int, free: int, where: str) -> None:
        super().__init__(
            f"not enough disk for the weights under {where}: {needed} bytes needed"
            f" (with margin), {free} free"
        )
        self.needed = needed
        self.free = free


class FetchDeadline(WeightsError):
    """The fetch's total deadline passed; the bytes fetched so far are kept for a resume."""

    retryable = True
