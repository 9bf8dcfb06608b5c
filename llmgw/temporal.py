"""Connecting to Temporal the one way every llmgw process does.

Every process builds its client with :func:`connect_with`, from the settings
(address, namespace, TLS, API key) its entry point read; :func:`connect` is the
step underneath, for callers that reach a server they started themselves.
"""

import asyncio
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client, Interceptor, WorkflowExecutionStatus
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from llmgw.errors import ConfigError, TemporalConnectError
from llmgw.settings import _Common


def tls_config(settings: _Common) -> TLSConfig | bool:
    """How the client speaks TLS, from ``LLMGW_TEMPORAL_TLS*``.

    TLS is on when ``LLMGW_TEMPORAL_TLS=true``, or when a CA, a client
    certificate or an API key is set (Temporal Cloud takes API keys over TLS
    only), unless ``LLMGW_TEMPORAL_TLS=false`` says otherwise. ``True`` means
    TLS with the system's trust store and nothing else to configure.

    Raises:
        ConfigError: A file cannot be read, a certificate comes without its
            key (or the reverse), or TLS is off while TLS files or an API key
            are set (the key would cross the network in clear). The message
            names the setting.
    """
    files = {
        "LLMGW_TEMPORAL_TLS_CA": settings.temporal_tls_ca,
        "LLMGW_TEMPORAL_TLS_CERT": settings.temporal_tls_cert,
        "LLMGW_TEMPORAL_TLS_KEY": settings.temporal_tls_key,
    }
    named = [name for name, path in files.items() if path is not None]
    if settings.temporal_tls_server_name:
        named.append("LLMGW_TEMPORAL_TLS_SERVER_NAME")
    if settings.temporal_tls is False:
        if settings.temporal_api_key.get_secret_value():
            raise ConfigError(
                "LLMGW_TEMPORAL_TLS=false, yet LLMGW_TEMPORAL_API_KEY set: the key would be"
                " sent in clear; unset one of them"
            )
        if named:
            raise ConfigError(f"LLMGW_TEMPORAL_TLS=false, yet {', '.join(named)} set")
        return False
    if not named:
        return bool(settings.temporal_tls or settings.temporal_api_key.get_secret_value())
    if (settings.temporal_tls_cert is None) != (settings.temporal_tls_key is None):
        raise ConfigError(
            "LLMGW_TEMPORAL_TLS_CERT and LLMGW_TEMPORAL_TLS_KEY go together (mTLS):"
            " set both or neither"
        )
    ca, cert, key = (_read(name, path) for name, path in files.items())
    return TLSConfig(
        server_root_ca_cert=ca,
        client_cert=cert,
        client_private_key=key,
        domain=settings.temporal_tls_server_name or None,
    )


def _read(setting: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{setting}: {path} is not PEM (no '-----BEGIN' line)")
    return data


async def connect_with(
    settings: _Common,
    interceptors: Sequence[Interceptor] = (),
    wait_s: float = 30.0,
    runtime: Runtime | None = None,
    waiting: Callable[[str], None] | None = None,
) -> Client:
    """The client of an llmgw process: the address, namespace, TLS and API key
    its settings name. See :func:`connect` for the rest."""
    api_key = settings.temporal_api_key.get_secret_value()
    return await connect(
        settings.temporal_address,
        settings.temporal_namespace,
        interceptors,
        wait_s,
        tls=tls_config(settings),
        api_key=api_key or None,
        runtime=runtime,
        waiting=waiting,
    )


async def connect(
    address: str,
    namespace: str = "default",
    interceptors: Sequence[Interceptor] = (),
    wait_s: float = 30.0,
    *,
    tls: TLSConfig | bool = False,
    api_key: str | None = None,
    runtime: Runtime | None = None,
    waiting: Callable[[str], None] | None = None,
) -> Client:
    """A client that carries llmgw's pydantic types (and traces, when given
    the tracing interceptor; workers built on the client inherit it).

    A server that is starting listens before it serves ("Frontend is not
    healthy yet", status Unavailable), and one that is frozen or overloaded
    takes the connection and does not answer (each try gives up after the
    SDK's 30 s): both are waited out for ``wait_s``, ``waiting`` told the
    reason once, when the first try fails.

    Raises:
        TemporalConnectError: No client after ``wait_s``, or a refusal that
            waiting cannot mend (a TLS handshake, a certificate).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await Client.connect(
                address,
                namespace=namespace,
                data_converter=pydantic_data_converter,
                interceptors=interceptors,
                tls=tls,
                api_key=api_key,
                runtime=runtime,
            )
        except RuntimeError as exc:
            reason = str(exc)
            if _retryable(reason) and loop.time() < deadline:
                if waiting is not None:
                    waiting(reason)
                    waiting = None
                await asyncio.sleep(0.25)
                continue
            raise TemporalConnectError(
                f"cannot connect to Temporal at {address} (namespace {namespace},"
                f" {_how(tls, api_key)}): {reason}{_hint(reason, tls)}"
            ) from exc


def _retryable(reason: str) -> bool:
    # A certificate the client cannot verify fails the same way every time;
    # only a server that is not serving yet, or not answering (frozen,
    # overloaded: the try timed out), is worth waiting for.
    if "certificate" in reason.lower() or "tls" in reason.lower():
        return False
    return "Unavailable" in reason or "Timeout expired" in reason


def _hint(reason: str, tls: TLSConfig | bool) -> str:
    """What the Rust client's error most likely means, in llmgw's settings."""
    if "UnknownIssuer" in reason:
        return (
            "\nhint: the server's certificate is not signed by a CA this client trusts;"
            " set LLMGW_TEMPORAL_TLS_CA to the CA's PEM file"
        )
    if "NotValidForName" in reason:
        return (
            "\nhint: the server's certificate does not name this address; set"
            " LLMGW_TEMPORAL_TLS_SERVER_NAME to a name it holds"
        )
    if "InvalidContentType" in reason:
        return "\nhint: the server does not speak TLS; unset LLMGW_TEMPORAL_TLS*"
    closed = "connection closed" in reason or "transport error" in reason
    if not tls and closed:
        return (
            "\nhint: a server that requires TLS closes a plain connection like this;"
            " set LLMGW_TEMPORAL_TLS_CA (or LLMGW_TEMPORAL_TLS=true)"
        )
    no_cert = not isinstance(tls, TLSConfig) or tls.client_cert is None
    if tls and no_cert and closed:
        return (
            "\nhint: a server that requires a client certificate (mTLS) closes the"
            " connection like this; set LLMGW_TEMPORAL_TLS_CERT and LLMGW_TEMPORAL_TLS_KEY"
        )
    return ""


def _how(tls: TLSConfig | bool, api_key: str | None) -> str:
    """How the client tried, for the error message: never the key itself."""
    if isinstance(tls, TLSConfig):
        parts = ["TLS"]
        if tls.server_root_ca_cert is not None:
            parts.append("server CA given")
        if tls.client_cert is not None:
            parts.append("client certificate")
        if tls.domain:
            parts.append(f"server name {tls.domain}")
        how = ", ".join(parts)
    else:
        how = "TLS with the system's CAs" if tls else "no TLS"
    return how + (", API key" if api_key else "")


async def workflow_running(client: Client, workflow_id: str) -> bool | None:
    """Whether a workflow runs; None when Temporal cannot say right now."""
    try:
        desc = await client.get_workflow_handle(workflow_id).describe(
            rpc_timeout=timedelta(seconds=5)
        )
    except RPCError as exc:
        return False if exc.status == RPCStatusCode.NOT_FOUND else None
    return desc.status == WorkflowExecutionStatus.RUNNING


def metrics_runtime(address: str) -> Runtime:
    """A Temporal runtime serving Prometheus metrics on ``address`` (host:port):
    the SDK's own and what workflows count through their metric meter."""
    return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=address)))
