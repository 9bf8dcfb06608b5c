"""The ``type`` of every ``ApplicationError`` that crosses Temporal.

An activity or workflow raises with one of these; a workflow, the router or
the CLI that needs to tell one failure from another matches the same
constant, so neither side retypes the other's string (AdapterBusy and
AdapterEngineFull were once mixed up that way).

Errors raised through ``LlmgwError.to_application_error`` carry their class
name: those constants equal the class names (tests/test_contracts.py checks).
The values are in stored histories and in older processes' code: never
change one.
"""

# Class names of llmgw.errors / project exceptions raised through Temporal
CONFIG_ERROR = "ConfigError"
ENGINE_LAUNCH_ERROR = "EngineLaunchError"
ENGINE_USER_ERROR = "EngineUserError"
ENGINE_EXITED_ERROR = "EngineExitedError"
ENGINE_NOT_READY_ERROR = "EngineNotReadyError"
ENGINE_INSTALL_ERROR = "EngineInstallError"
LAUNCH_VALIDATION_ERROR = "LaunchValidationError"
# A weights fetch (worker_agent/weights.py)
WEIGHTS_ERROR = "WeightsError"
UNSUPPORTED_SOURCE = "UnsupportedSource"
CHECKSUM_MISMATCH = "ChecksumMismatch"
SOURCE_MISSING = "SourceMissing"
SOURCE_OUTSIDE_ROOTS = "SourceOutsideRoots"

# The agent is stopping: a watch retried on the next agent process resumes.
AGENT_SHUTDOWN = "AgentShutdown"
# A multi-node start failed and every rank it started was stopped.
RENDEZVOUS_FAILED = "RendezvousFailed"

# LoRA adapter loads and unloads (activities/agent/adapters.py)
ENGINE_GONE = "EngineGone"
ADAPTER_OUTSIDE_ROOTS = "AdapterOutsideRoots"
ADAPTER_NOT_FOUND = "AdapterNotFound"
ADAPTER_LOAD_FAILED = "AdapterLoadFailed"
# The engine holds its cap of adapters, none idle: nothing was unloaded.
ADAPTER_ENGINE_FULL = "AdapterEngineFull"
# The adapter chosen for unloading has requests in flight: it is still loaded.
ADAPTER_BUSY = "AdapterBusy"
ADAPTER_UNLOAD_FAILED = "AdapterUnloadFailed"
