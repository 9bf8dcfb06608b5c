"""The strings that cross processes keep their values.

Stored histories, running workflows and older clients carry them: a renamed
constant is fine, a changed value is not.
"""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

from llmgw import error_types, errors, messages
from worker_agent import weights
from worker_agent.engines.spec import LaunchValidationError
from worker_agent.installs.steps import EngineInstallError

WIRE_MESSAGES = {
    "FLEET": "Fleet",
    "REPLICA": "Replica",
    "DEPLOYMENT": "Deployment",
    "RENDEZVOUS": "Rendezvous",
    "DRAIN_NODE": "DrainNode",
    "ADAPTER_LOAD": "AdapterLoad",
    "SHARD_LOGS": "ShardLogs",
    "REGISTER_NODE": "register_node",
    "DEREGISTER_NODE": "deregister_node",
    "PLACE": "place",
    "PLACE_BATCH": "place_batch",
    "RELEASE": "release",
    "CORDON": "cordon",
    "SNAPSHOT": "snapshot",
    "NODES": "nodes",
    "STOP": "stop",
    "REQUEST_STOP": "request_stop",
    "ADAPTERS_CHANGED": "adapters_changed",
    "REPLICA_READY": "replica_ready",
    "REPLICA_ENDED": "replica_ended",
    "SCALE": "scale",
    "SET_MODEL": "set_model",
    "ROLLING_RESTART": "rolling_restart",
    "STATUS": "status",
    "REPORT_LOAD": "report_load",
    "WAKE": "wake",
    "SET_AUTOSCALE": "set_autoscale",
}


def _constants(module: object) -> dict[str, str]:
    return {k: v for k, v in vars(module).items() if k.isupper() and isinstance(v, str)}


def test_message_names_keep_their_values() -> None:
    assert _constants(messages) == WIRE_MESSAGES


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
    }
    assert {name: cls.__name__ for name, cls in pairs.items()} == {n: n for n in pairs}


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
    """router/errors.py is the one place that says what a client sees on failure."""
    root = Path(__file__).resolve().parent.parent / "router"
    built_elsewhere = [
        f"{path.relative_to(root.parent)}:{node.lineno}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "errors.py" or path.parent != root
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "OpenAIError"
    ]
    assert built_elsewhere == []
