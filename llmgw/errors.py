"""The llmgw error hierarchy.

Every exception class the project defines derives from ``LlmgwError``
(tests/test_contracts.py walks the packages to check). Classes outside this
module are named with where they live::

    LlmgwError                    base of everything raised on purpose
    ├── ConfigError               bad settings or input; retrying cannot help
    │   └── LaunchValidationError a shard that must not start, with every reason
    │                             (worker_agent/engines/spec.py; also a ValueError)
    ├── StoreError                the store could not answer
    ├── FileTooLarge              a file past its size bound: nothing of it kept
    │   │                         (llmgw/store/files.py)
    │   └── KeyStorageFull        ...past what its key's files may hold in all
    ├── TemporalConnectError      no Temporal client: unreachable, or refused (TLS, API key)
    ├── InstanceRunningError      another live ``llmgw up`` holds the work dir (llmgw_cli/up.py)
    ├── EngineError               an engine shard misbehaved
    │   ├── EngineLaunchError     it could not be started
    │   │   ├── EngineUserError   ...because it would have to run as root
    │   │   └── RendezvousFailed  ...on several nodes; every rank started was stopped
    │   ├── EngineExitedError     it exited (exit code and log tail in message)
    │   ├── EngineNotReadyError   it did not become ready in time
    │   ├── EngineGone            the node runs no engine for the replica (any more)
    │   ├── EngineAnswerRefused   an answer not read: compressed, past its size cap, or not
    │   │                         whole by its deadline (llmgw/bounded_http.py)
    │   └── UpstreamError         the router's request to it failed (mid-way)
    │       └── UpstreamConnectError  ...before the client had anything: another may take it
    │           └── UpstreamHostGone  ...its host stopped answering before a byte came back
    ├── EngineInstallError        an engine could not be installed (worker_agent/installs/)
    ├── WeightsError              a weights fetch failed (worker_agent/weights.py)
    │   ├── UnsupportedSource     ...from a kind of source the agent cannot read
    │   ├── ChecksumMismatch      ...to a digest other than the expected one
    │   ├── SourceMissing         ...from a path that does not exist
    │   ├── SourceOutsideRoots    ...from outside the weights roots
    │   ├── SourceUnavailable     ...the remote source cannot answer now: retried
    │   │   │                     (worker_agent/fetch/errors.py, as the four below)
    │   │   └── FetchStalled      ...no byte for the stall window
    │   ├── SourceRefused         ...HTTP 401, 403, 404 or 410: never retried
    │   ├── FileMismatch          ...a fetched file's size or sha256 (a ChecksumMismatch)
    │   ├── DiskTooSmall          ...too little free disk for what is left to fetch
    │   └── FetchDeadline         ...the fetch's total deadline passed
    ├── AdapterError              a LoRA adapter change on a node failed
    │   │                         (raised by activities/agent/adapters.py)
    │   ├── AdapterOutsideRoots   ...its path is outside the adapter roots
    │   ├── AdapterNotFound       ...its path does not exist on the node
    │   ├── AdapterLoadFailed     ...the engine refused or failed the load
    │   ├── AdapterEngineFull     ...the engine holds its cap, none idle: nothing unloaded
    │   ├── AdapterBusy           ...the adapter to unload has requests in flight
    │   └── AdapterUnloadFailed   ...the engine failed the unload
    ├── AgentShutdown             the agent is stopping: the activity resumes on the next one
    ├── GpuDiscoveryUnavailable   no NVML on this node: a CPU node (worker_agent/gpus.py)
    ├── IllegalTransition         a replica phase change the lifecycle forbids: a bug
    │                             (workflows/replica_state.py; also a ValueError)
    ├── OpenAIError               what a router client sees: status and OpenAI error JSON,
    │                             built in router/common/errors.py
    ├── AdapterUnavailable        the router could not have a LoRA adapter loaded
    │                             (router/control_link/adapters.py; it reports the
    │                             wire AdapterError.AdapterLoadFailed among others)
    ├── RequestInvalid            a /v1/responses body llmgw refuses, with the field at
    │                             fault (router/responses/request.py)
    ├── ResponseEventsError       the Responses event machine used out of order: a bug
    │   │                         (router/responses/replay.py)
    │   └── NotResumable          stored events it cannot continue from (a gap, an open call)
    ├── PreviousNotFound          a previous_response_id with no stored response of the key
    │                             (router/responses/chain.py)
    ├── PreviousFailed            a previous_response_id naming a failed response
    │                             (router/responses/chain.py)
    ├── ChainTooLarge             a previous_response_id chain past the stored-size bound:
    │                             loading stopped there (router/responses/chain.py)
    ├── KeyStorageFull            a key's stored responses would pass their bound
    │                             (router/responses/store.py)
    ├── RunLost                   another run of a background response stored its events
    │                             first (router/responses/store.py)
    ├── RunInterrupted            a background run's engine stream broke off: the executor
    │                             retries it (router/api/response_run.py)
    ├── BodyRefused               a batch line's body its endpoint would refuse, with the
    │                             field at fault (router/batches/validate.py)
    ├── StaleAdapter              the engine no longer holds the LoRA adapter the router
    │                             sent it to (router/forwarding/proxy.py)
    └── SlotStuck                 a stream pinned to a llama.cpp slot had no first byte in
                                  time: sent once more, the slot left out
                                  (router/forwarding/proxy.py)

The replica workflow's private ``_StopRequested`` and ``NoAgent``
(workflows/node_loss.py) derive from the root too; they never leave the
workflow. So do router/forwarding/upstream_raw.py's ``_Stale`` (a kept-alive
connection closed unanswered) and ``_Refused`` (the parser stopped at an
encoded answer's head), which never leave the engine client, and
worker_agent/fetch/body.py's ``BodyTooLong`` (more bytes than the pinned
size), which its caller reports as a FileMismatch.

Errors that cross Temporal are raised as ``ApplicationError`` with ``type``
set to the class name and ``non_retryable`` from the class, so a workflow can
tell "try again" from "give up" without importing process code; every type
string that crosses is in ``llmgw/error_types.py``.
"""

from temporalio.exceptions import ApplicationError


class LlmgwError(Exception):
    """Base class of every error llmgw raises on purpose."""

    retryable: bool = True

    def to_application_error(self) -> ApplicationError:
        """This error as Temporal carries it: a string type and a retry verdict."""
        return ApplicationError(
            str(self), type=type(self).__name__, non_retryable=not self.retryable
        )


class ConfigError(LlmgwError):
    """Bad settings or bad input: retrying cannot help."""

    retryable = False


class StoreError(LlmgwError):
    """The store could not answer."""


class FileTooLarge(LlmgwError):
    """A file written to the store (an upload, a batch's results) went past its
    size bound; what was written of it is removed again."""

    retryable = False

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than {limit} bytes")
        self.limit = limit


class KeyStorageFull(FileTooLarge):
    """An upload would take its key's files past their total bound
    (``LLMGW_MAX_KEY_FILE_BYTES``); what was written of it is removed again."""

    def __init__(self, limit: int, used: int) -> None:
        super().__init__(limit)
        self.args = (f"the key's files would hold more than {limit} bytes ({used} in use)",)
        self.used = used


class TemporalConnectError(LlmgwError):
    """No Temporal client could be made: the server is unreachable or refused
    the connection (TLS handshake, certificate, API key). The message says how
    llmgw tried, never the key."""


class InstanceRunningError(LlmgwError):
    """Another live ``llmgw up`` holds this work dir's lock: nothing of it is touched."""

    retryable = False


class EngineError(LlmgwError):
    """An engine shard misbehaved."""


class EngineLaunchError(EngineError):
    """The engine could not be started (binary missing, bad model path...)."""

    retryable = False


class EngineUserError(EngineLaunchError):
    """The engine user is missing or unusable and root engines are not allowed."""


class EngineExitedError(EngineError):
    """The engine exited; the message carries the exit code and its log tail."""

    retryable = False


class EngineNotReadyError(EngineError):
    """The engine did not become ready before its deadline."""

    retryable = False


class UpstreamError(EngineError):
    """The router's request to an engine failed after it may have started there."""


class UpstreamConnectError(UpstreamError):
    """The router could not reach an engine: nothing was sent, another replica may answer."""


class UpstreamHostGone(UpstreamConnectError):
    """An engine's host stopped acknowledging the connection (TCP keepalive or
    user timeout: a partition, a power loss) before a byte of the answer came.

    The request may have reached the engine, but nothing it does can come
    back, and the client has seen nothing: another replica may answer.
    """


class EngineAnswerRefused(EngineError):
    """An engine's answer the agent or router would not read (llmgw/bounded_http.py):
    compressed (an engine is asked for identity), longer than the reader's cap,
    or not whole within its deadline. The message says which, never the body."""


class EngineGone(EngineError):
    """The node runs no engine for the replica (it exited, or was never there)."""

    retryable = False


class RendezvousFailed(EngineLaunchError):
    """A multi-node start failed; every rank it had started was stopped."""


class AdapterError(LlmgwError):
    """A LoRA adapter load or unload on a node failed."""


class AdapterOutsideRoots(AdapterError):
    """The adapter's path is outside the node's adapter roots."""

    retryable = False


class AdapterNotFound(AdapterError):
    """The adapter's path does not exist on the node."""

    retryable = False


class AdapterLoadFailed(AdapterError):
    """The engine refused or failed the load. Whether a retry may help depends
    on its answer (a bad adapter will not load later; a busy engine may)."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class AdapterEngineFull(AdapterError):
    """The engine holds its cap of adapters and none is idle: nothing was unloaded."""

    retryable = False


class AdapterBusy(AdapterError):
    """The adapter chosen for unloading has requests in flight: it is still loaded."""

    retryable = False


class AdapterUnloadFailed(AdapterError):
    """The engine failed the unload."""


class AgentShutdown(LlmgwError):
    """The agent is stopping; a retry on the next agent process resumes the work
    (the engine outlives the agent)."""
