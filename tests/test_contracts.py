"""The strings that cross processes keep their values.

Stored histories, running workflows and older clients carry them: a renamed
constant is fine, a changed value is not.
"""

import ast
import importlib
import inspect
import pkgutil
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow

from llmgw import contracts, error_types, errors
from worker_agent import weights
from worker_agent.engines.spec import LaunchValidationError
from worker_agent.installs.steps import EngineInstallError

# Every descriptor's wire name: workflow types, signals, updates, queries,
# activities and memo keys. Stored histories and running workflows carry them.
WIRE_NAMES = {
    # Workflow types
    "FLEET": "Fleet",
    "REPLICA": "Replica",
    "DEPLOYMENT": "Deployment",
    "RENDEZVOUS": "Rendezvous",
    "DRAIN_NODE": "DrainNode",
    "MODEL_PULL": "ModelPull",
    "ADAPTER_LOAD": "AdapterLoad",
    "SHARD_LOGS": "ShardLogs",
    "BATCH": "Batch",
    "RESPONSE": "BackgroundResponse",
    "CANCEL_BATCH": "cancel_batch",
    "CANCEL_RESPONSE": "cancel_response",
    "VALIDATE_BATCH": "validate_batch",
    "SET_BATCH_STATUS": "set_batch_status",
    "RUN_CHUNK": "run_chunk",
    "FINALIZE_BATCH": "finalize_batch",
    "RUN_RESPONSE": "run_response",
    "BATCH_MEMO": "batch",
    # Fleet
    "REGISTER_NODE": "register_node",
    "DEREGISTER_NODE": "deregister_node",
    "PLACE": "place",
    "PLACE_BATCH": "place_batch",
    "RELEASE": "release",
    "CORDON": "cordon",
    "SNAPSHOT": "snapshot",
    "NODES": "nodes",
    # Replica
    "STOP": "stop",
    "REQUEST_STOP": "request_stop",
    "ADAPTERS_CHANGED": "adapters_changed",
    "REPLICA_STATUS": "status",
    # Deployment
    "REPLICA_READY": "replica_ready",
    "REPLICA_ENDED": "replica_ended",
    "SCALE": "scale",
    "SET_MODEL": "set_model",
    "ROLLING_RESTART": "rolling_restart",
    "DEPLOYMENT_STATUS": "status",
    "REPORT_LOAD": "report_load",
    "WAKE": "wake",
    "SET_AUTOSCALE": "set_autoscale",
    # Activities: control queue
    "PLACE_REPLICA": "place_replica",
    "RELEASE_REPLICA": "release_replica",
    "VALIDATE_REPLICA": "validate_replica",
    "FLEET_CORDON": "fleet_cordon",
    "PROBE_ENGINE": "probe_engine",
    # Activities: node queues
    "FETCH_WEIGHTS": "fetch_weights",
    "RESERVE_PORT": "reserve_port",
    "LAUNCH_SHARD": "launch_shard",
    "WAIT_SHARD_READY": "wait_shard_ready",
    "WATCH_SHARD": "watch_shard",
    "STOP_SHARD": "stop_shard",
    "DRAIN_SHARD": "drain_shard",
    "SHARD_LOG_TAIL": "shard_log_tail",
    "SHARD_LOAD": "shard_load",
    "SHARD_RUNNING": "shard_running",
    "LOAD_ADAPTER": "load_adapter",
    "UNLOAD_ADAPTER": "unload_adapter",
    # Memo keys
    "REPLICA_MEMO": "replica",
    "FLEET_NODES_MEMO": "nodes",
}

Descriptor = (
    contracts.WorkflowType[Any, Any]
    | contracts.Signal[Any]
    | contracts.Update[Any, Any]
    | contracts.Query[Any, Any]
    | contracts.Activity[Any, Any]
)
_KINDS = (
    contracts.WorkflowType,
    contracts.Signal,
    contracts.Update,
    contracts.Query,
    contracts.Activity,
)


def _descriptors() -> dict[str, Descriptor]:
    return {k: v for k, v in vars(contracts).items() if isinstance(v, _KINDS)}


def test_every_wire_name_keeps_its_value() -> None:
    found: dict[str, str] = {k: d.name for k, d in _descriptors().items()}
    found |= {k: m.key for k, m in vars(contracts).items() if isinstance(m, contracts.Memo)}
    assert found == WIRE_NAMES


def test_the_descriptor_lists_hold_every_descriptor_once() -> None:
    listed = [*contracts.WORKFLOWS, *contracts.MESSAGES, *contracts.ACTIVITIES]
    assert len(listed) == len({id(d) for d in listed})
    assert {id(d) for d in listed} == {id(d) for d in _descriptors().values()}


def _walk(package: str) -> Iterator[type]:
    """The classes defined in ``package``'s modules."""
    path = importlib.import_module(package).__path__
    for info in pkgutil.walk_packages(path, f"{package}."):
        module = importlib.import_module(info.name)
        yield from (
            obj
            for obj in vars(module).values()
            if inspect.isclass(obj) and obj.__module__ == module.__name__
        )


def _signature(fn: Callable[..., Any]) -> tuple[object, object]:
    """(input annotation, return annotation) of a handler; ``NoneType`` for
    one taking nothing besides ``self``."""
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    assert len(params) <= 1, f"{fn.__qualname__} takes more than one input"
    return (hints[params[0]] if params else type(None)), hints["return"]


# (kind, workflow type or "" for an activity, name) -> the handler's signature
Handlers = dict[tuple[str, str, str], list[tuple[str, tuple[object, object]]]]


def _handlers() -> Handlers:
    found: Handlers = {}

    def add(key: tuple[str, str, str], fn: Callable[..., Any]) -> None:
        found.setdefault(key, []).append((fn.__qualname__, _signature(fn)))

    for cls in _walk("workflows"):
        defn = workflow._Definition.from_class(cls)
        if defn is None:
            continue
        assert defn.name is not None, f"{cls.__qualname__} is a dynamic workflow"
        add(("workflow", "", defn.name), defn.run_fn)
        for kind, handlers in (
            ("signal", defn.signals),
            ("update", defn.updates),
            ("query", defn.queries),
        ):
            for name, handler in handlers.items():
                assert name is not None, f"{cls.__qualname__} has a dynamic {kind} handler"
                add((kind, defn.name, name), handler.fn)
    for package in ("activities.control", "activities.agent"):
        for cls in _walk(package):
            for _, fn in inspect.getmembers(cls, inspect.isfunction):
                adefn = activity._Definition.from_callable(fn)
                if adefn is not None:
                    assert adefn.name is not None, f"{fn.__qualname__} is a dynamic activity"
                    add(("activity", "", adefn.name), fn)
    return found


def _key(d: Descriptor) -> tuple[str, str, str]:
    if isinstance(d, contracts.WorkflowType):
        return ("workflow", "", d.name)
    if isinstance(d, contracts.Activity):
        return ("activity", "", d.name)
    kind = {contracts.Signal: "signal", contracts.Update: "update", contracts.Query: "query"}
    return (kind[type(d)], d.workflow, d.name)


def _expected(d: Descriptor) -> tuple[object, object]:
    return (d.input, type(None) if isinstance(d, contracts.Signal) else d.result)


def test_every_descriptor_has_one_handler_typed_as_it_says() -> None:
    handlers = _handlers()
    assert len(handlers) > 40  # the walk did reach the workflows and activities
    descriptors = {_key(d): d for d in _descriptors().values()}
    assert len(descriptors) == len(_descriptors())  # no two descriptors for one handler
    assert sorted(set(handlers) - set(descriptors)) == []  # every handler has a descriptor
    assert sorted(set(descriptors) - set(handlers)) == []  # every descriptor a handler
    assert {k: len(v) for k, v in handlers.items() if len(v) != 1} == {}
    wrong = {
        f"{k}: {handlers[k][0][0]}": (handlers[k][0][1], _expected(d))
        for k, d in descriptors.items()
        if handlers[k][0][1] != _expected(d)
    }
    assert wrong == {}


async def test_a_signal_starts_only_its_own_workflow_type() -> None:
    """Signal-with-start of the wrong type is refused before any call (no client used)."""
    client: Any = None
    nothing: Any = None
    with pytest.raises(ValueError, match="register_node is a signal of Fleet, not Replica"):
        await contracts.REGISTER_NODE.send_with_start(
            client, contracts.REPLICA, nothing, nothing, id="x", task_queue="q"
        )


def test_memos_round_trip_as_their_writers_store_them() -> None:
    nodes = contracts.FleetNodes({"n1": "10.0.0.1"})
    # The stored shape is the plain object the Fleet published before the
    # descriptor existed: a RootModel adds no wrapper.
    assert contracts.FLEET_NODES_MEMO.encode(nodes) == {"nodes": {"n1": "10.0.0.1"}}
    assert contracts.FLEET_NODES_MEMO.decode({"nodes": {"n1": "10.0.0.1"}}) == nodes
    assert contracts.FLEET_NODES_MEMO.decode({}) is None
    assert contracts.REPLICA_MEMO.decode({"replica": "not an object"}) is None


def _constants(module: object) -> dict[str, str]:
    return {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


WIRE_ERROR_TYPES = {
    "CONFIG_ERROR": "ConfigError",
    "ENGINE_LAUNCH_ERROR": "EngineLaunchError",
    "ENGINE_USER_ERROR": "EngineUserError",
    "ENGINE_EXITED_ERROR": "EngineExitedError",
    "ENGINE_NOT_READY_ERROR": "EngineNotReadyError",
    "ENGINE_INSTALL_ERROR": "EngineInstallError",
    "LAUNCH_VALIDATION_ERROR": "LaunchValidationError",
    "WEIGHTS_ERROR": "WeightsError",
    "UNSUPPORTED_SOURCE": "UnsupportedSource",
    "CHECKSUM_MISMATCH": "ChecksumMismatch",
    "SOURCE_MISSING": "SourceMissing",
    "SOURCE_OUTSIDE_ROOTS": "SourceOutsideRoots",
    "AGENT_SHUTDOWN": "AgentShutdown",
    "RENDEZVOUS_FAILED": "RendezvousFailed",
    "ENGINE_GONE": "EngineGone",
    "ADAPTER_OUTSIDE_ROOTS": "AdapterOutsideRoots",
    "ADAPTER_NOT_FOUND": "AdapterNotFound",
    "ADAPTER_LOAD_FAILED": "AdapterLoadFailed",
    "ADAPTER_ENGINE_FULL": "AdapterEngineFull",
    "ADAPTER_BUSY": "AdapterBusy",
    "ADAPTER_UNLOAD_FAILED": "AdapterUnloadFailed",
}


def test_error_types_keep_their_values() -> None:
    assert _constants(error_types) == WIRE_ERROR_TYPES


def test_error_types_raised_from_classes_are_their_class_names() -> None:
    """``to_application_error`` sends the class name: the constant must be it."""
    pairs = {
        error_types.CONFIG_ERROR: errors.ConfigError,
        error_types.ENGINE_LAUNCH_ERROR: errors.EngineLaunchError,
        error_types.ENGINE_USER_ERROR: errors.EngineUserError,
        error_types.ENGINE_EXITED_ERROR: errors.EngineExitedError,
        error_types.ENGINE_NOT_READY_ERROR: errors.EngineNotReadyError,
        error_types.ENGINE_INSTALL_ERROR: EngineInstallError,
        error_types.LAUNCH_VALIDATION_ERROR: LaunchValidationError,
        error_types.WEIGHTS_ERROR: weights.WeightsError,
        error_types.UNSUPPORTED_SOURCE: weights.UnsupportedSource,
        error_types.CHECKSUM_MISMATCH: weights.ChecksumMismatch,
        error_types.SOURCE_MISSING: weights.SourceMissing,
        error_types.SOURCE_OUTSIDE_ROOTS: weights.SourceOutsideRoots,
        error_types.AGENT_SHUTDOWN: errors.AgentShutdown,
        error_types.RENDEZVOUS_FAILED: errors.RendezvousFailed,
        error_types.ENGINE_GONE: errors.EngineGone,
        error_types.ADAPTER_OUTSIDE_ROOTS: errors.AdapterOutsideRoots,
        error_types.ADAPTER_NOT_FOUND: errors.AdapterNotFound,
        error_types.ADAPTER_LOAD_FAILED: errors.AdapterLoadFailed,
        error_types.ADAPTER_ENGINE_FULL: errors.AdapterEngineFull,
        error_types.ADAPTER_BUSY: errors.AdapterBusy,
        error_types.ADAPTER_UNLOAD_FAILED: errors.AdapterUnloadFailed,
    }
    # Every type that crosses has its class (none is raised as a bare string).
    assert set(pairs) == set(_constants(error_types).values())
    assert {name: cls.__name__ for name, cls in pairs.items()} == {n: n for n in pairs}
    for name, cls in pairs.items():
        if issubclass(cls, errors.LlmgwError):
            assert cls("x").to_application_error().type == name


PACKAGES = ("llmgw", "workflows", "activities", "router", "worker_agent", "llmgw_cli")


def _project_exceptions() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, f"{package}."):
            if info.name.endswith(".__main__"):
                continue
            module = importlib.import_module(info.name)
            found += [
                obj
                for obj in vars(module).values()
                if inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ]
    return found


def test_every_project_exception_is_under_the_root_and_drawn_in_the_tree() -> None:
    found = _project_exceptions()
    assert len(found) > 20  # the walk did reach the packages
    assert [c.__qualname__ for c in found if not issubclass(c, errors.LlmgwError)] == []
    assert errors.__doc__ is not None
    assert [c.__qualname__ for c in found if c.__name__ not in errors.__doc__] == []


def test_router_failures_are_built_in_router_errors() -> None:
    """router/common/errors.py is the one place that says what a client sees on failure."""
    root = Path(__file__).resolve().parent.parent / "router"
    built_elsewhere = [
        f"{path.relative_to(root.parent)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).as_posix() != "common/errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "OpenAIError"
    ]
    assert built_elsewhere == []
