"""Temporal over TLS and mTLS, with certificates from a throwaway CA.

The dev server cannot serve TLS, so it sits behind tests/tls_front.py (see
there); every handshake below is real, and the mTLS front refuses a client
without a certificate from the CA. The processes also run in a namespace of
their own: one that read ``default`` anywhere would never see its tasks.
"""

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client
from temporalio.service import TLSConfig

from llmgw import replicas
from llmgw.errors import ConfigError, TemporalConnectError
from llmgw.settings import ControlSettings
from llmgw.temporal import connect_with, tls_config
from llmgw.types import EngineKind, ModelSpec
from llmgw_cli.dev.tinymodel import TinyModel
from tests.harness import System, free_port, start_devserver, wait_routable
from tests.tls_front import Pki, TlsFront, issue, make_ca, make_pki

NAMESPACE = "llmgw-tls"
API_KEY = "tmprl-test-key-8c1e5f"  # the dev server ignores it; it must never be logged
MODEL = "tiny-tls"


def settings(address: str, **tls: Any) -> ControlSettings:
    return ControlSettings(temporal_address=address, temporal_namespace=NAMESPACE, **tls)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def plain_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A dev server of this module's own, with the namespace the processes use."""
    root = tmp_path_factory.mktemp("temporal-tls")
    port = free_port()
    server = start_devserver(root / "temporal.db", port, root / "temporal.log", [NAMESPACE])
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def tls_front(pki: Pki, plain_address: str) -> Iterator[TlsFront]:
    front = TlsFront(free_port(), plain_address, pki.server_cert, pki.server_key)
    front.start()
    yield front
    front.stop()


@pytest.fixture(scope="module")
def mtls_front(pki: Pki, plain_address: str) -> Iterator[TlsFront]:
    front = TlsFront(free_port(), plain_address, pki.server_cert, pki.server_key, pki.ca)
    front.start()
    yield front
    front.stop()


def at(front: TlsFront) -> str:
    return f"127.0.0.1:{front.port}"


# --- settings -> TLS configuration ------------------------------------------


def test_no_settings_no_tls() -> None:
    assert tls_config(settings("x:1")) is False


def test_api_key_alone_turns_tls_on() -> None:
    # Temporal Cloud takes API keys over TLS only, with public CAs.
    assert tls_config(settings("x:1", temporal_api_key=API_KEY)) is True


def test_files_and_server_name_make_the_tls_config(pki: Pki) -> None:
    got = tls_config(
        settings(
            "x:1",
            temporal_tls_ca=pki.ca,
            temporal_tls_cert=pki.client_cert,
            temporal_tls_key=pki.client_key,
            temporal_tls_server_name="temporal.internal",
        )
    )
    assert isinstance(got, TLSConfig)
    assert got.server_root_ca_cert == pki.ca.read_bytes()
    assert got.client_cert == pki.client_cert.read_bytes()
    assert got.client_private_key == pki.client_key.read_bytes()
    assert got.domain == "temporal.internal"


@pytest.mark.parametrize(
    ("field", "make", "says"),
    [
        ("temporal_tls_ca", lambda d: d / "missing.pem", "LLMGW_TEMPORAL_TLS_CA: cannot read"),
        ("temporal_tls_ca", lambda d: d, "LLMGW_TEMPORAL_TLS_CA: cannot read"),
        ("temporal_tls_ca", lambda d: _write(d / "ca.txt", "not a cert"), "is not PEM"),
    ],
)
def test_an_unreadable_file_names_its_setting(
    tmp_path: Path, field: str, make: Callable[[Path], Path], says: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError) as err:
        tls_config(settings("x:1", **{field: path}))
    assert says in str(err.value)
    assert str(path) in str(err.value)


def test_an_unreadable_key_names_its_setting(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="LLMGW_TEMPORAL_TLS_KEY: cannot read"):
        tls_config(
            settings(
                "x:1",
                temporal_tls_cert=pki.client_cert,
                temporal_tls_key=tmp_path / "gone.key",
            )
        )


def test_a_certificate_needs_its_key(pki: Pki) -> None:
    with pytest.raises(ConfigError, match="LLMGW_TEMPORAL_TLS_CERT and LLMGW_TEMPORAL_TLS_KEY"):
        tls_config(settings("x:1", temporal_tls_cert=pki.client_cert))


def test_tls_off_with_tls_files_is_refused(pki: Pki) -> None:
    with pytest.raises(ConfigError, match="LLMGW_TEMPORAL_TLS=false, yet LLMGW_TEMPORAL_TLS_CA"):
        tls_config(settings("x:1", temporal_tls=False, temporal_tls_ca=pki.ca))


def test_tls_off_with_an_api_key_is_refused() -> None:
    # The key would cross the network in clear.
    with pytest.raises(ConfigError, match="LLMGW_TEMPORAL_TLS=false, yet LLMGW_TEMPORAL_API_KEY"):
        tls_config(settings("x:1", temporal_tls=False, temporal_api_key=API_KEY))


async def test_no_process_connects_with_tls_off_and_an_api_key() -> None:
    # Refused before any connection is tried (nothing listens at x:1).
    with pytest.raises(ConfigError, match="in clear"):
        await connect_with(settings("x:1", temporal_tls=False, temporal_api_key=API_KEY), wait_s=0)


def test_api_key_is_not_in_the_settings_repr() -> None:
    s = settings("x:1", temporal_api_key=API_KEY)
    assert API_KEY not in repr(s) and API_KEY not in str(s.model_dump())


def test_llmgw_up_children_leave_cluster_settings_behind(tmp_path: Path) -> None:
    # `llmgw up` serves its own plain dev server on loopback; TLS files, a key
    # or a namespace meant for a cluster would keep its children off it.
    script = (
        "import json; from llmgw.settings import UpSettings; from llmgw_cli.up import child_env;"
        " print(json.dumps(child_env(UpSettings())))"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "LLMGW_WORK_DIR": str(tmp_path),
        "LLMGW_TEMPORAL_NAMESPACE": "prod",
        "LLMGW_TEMPORAL_TLS_CA": "/etc/temporal/ca.pem",
        "LLMGW_TEMPORAL_API_KEY": API_KEY,
    }
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    ).stdout
    temporal = {k: v for k, v in json.loads(out).items() if k.startswith("LLMGW_TEMPORAL_")}
    assert temporal == {"LLMGW_TEMPORAL_ADDRESS": "127.0.0.1:7233"}


# --- real handshakes ----------------------------------------------------------


async def refused(s: ControlSettings, front: TlsFront) -> tuple[str, list[str]]:
    """Connect and expect a refusal: the error, and what the front saw meanwhile."""
    before = len(front.handshakes.failed)
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(TemporalConnectError) as err:
        await connect_with(s, wait_s=30)
    # A refusal is final: it is not waited out as a server starting would be.
    assert loop.time() - start < 20
    # The front records its side of the handshake in its own thread, at times
    # after the client has already given up.
    async with asyncio.timeout(10):
        while len(front.handshakes.failed) == before:
            await asyncio.sleep(0.01)
    return str(err.value), front.handshakes.failed[before:]


async def test_a_plain_client_is_refused_clearly(tls_front: TlsFront) -> None:
    # Without an API key: TLS off with one is refused before connecting
    # (test_no_process_connects_with_tls_off_and_an_api_key).
    message, seen = await refused(settings(at(tls_front), temporal_tls=False), tls_front)
    assert "no TLS" in message and "LLMGW_TEMPORAL_TLS_CA" in message
    assert any("WRONG_VERSION_NUMBER" in s for s in seen), seen


async def test_a_wrong_ca_is_refused_clearly(tls_front: TlsFront, tmp_path: Path) -> None:
    other_ca, _ = make_ca(tmp_path, "other-ca")
    message, seen = await refused(settings(at(tls_front), temporal_tls_ca=other_ca), tls_front)
    assert "UnknownIssuer" in message and "not signed by a CA this client trusts" in message
    assert any("UNKNOWN_CA" in s for s in seen), seen


async def test_system_cas_do_not_trust_an_internal_ca(tls_front: TlsFront) -> None:
    message, _ = await refused(settings(at(tls_front), temporal_tls=True), tls_front)
    assert "TLS with the system's CAs" in message and "UnknownIssuer" in message


async def test_server_name_override(tls_front: TlsFront, pki: Pki) -> None:
    # The certificate names localhost and 127.0.0.1: an address it does not
    # name is reached with the override, and a wrong override is refused.
    good = settings(at(tls_front), temporal_tls_ca=pki.ca, temporal_tls_server_name="localhost")
    await (await connect_with(good)).count_workflows()
    message, _ = await refused(
        settings(at(tls_front), temporal_tls_ca=pki.ca, temporal_tls_server_name="tmprl.example"),
        tls_front,
    )
    assert "LLMGW_TEMPORAL_TLS_SERVER_NAME" in message


async def test_mtls_refuses_a_client_without_a_certificate(mtls_front: TlsFront, pki: Pki) -> None:
    message, seen = await refused(settings(at(mtls_front), temporal_tls_ca=pki.ca), mtls_front)
    assert "LLMGW_TEMPORAL_TLS_CERT" in message
    assert any("PEER_DID_NOT_RETURN_A_CERTIFICATE" in s for s in seen), seen


async def test_mtls_refuses_a_certificate_from_another_ca(
    mtls_front: TlsFront, pki: Pki, tmp_path: Path
) -> None:
    stranger = issue(tmp_path, "stranger", make_ca(tmp_path, "stranger-ca"), "clientAuth")
    _, seen = await refused(
        settings(
            at(mtls_front),
            temporal_tls_ca=pki.ca,
            temporal_tls_cert=stranger[0],
            temporal_tls_key=stranger[1],
        ),
        mtls_front,
    )
    assert any("CERTIFICATE_VERIFY_FAILED" in s for s in seen), seen


# --- the system over mTLS -----------------------------------------------------


def mtls_env(pki: Pki) -> dict[str, str]:
    return {
        "LLMGW_TEMPORAL_NAMESPACE": NAMESPACE,
        "LLMGW_TEMPORAL_TLS_CA": str(pki.ca),
        "LLMGW_TEMPORAL_TLS_CERT": str(pki.client_cert),
        "LLMGW_TEMPORAL_TLS_KEY": str(pki.client_key),
        "LLMGW_TEMPORAL_API_KEY": API_KEY,
    }


@pytest.fixture
def system(mtls_front: TlsFront, pki: Pki, tmp_path: Path) -> Iterator[System]:
    sys_ = System(at(mtls_front), tmp_path / "llmgw", free_port(), mtls_env(pki))
    sys_.work_dir.mkdir()
    yield sys_
    sys_.stop()


@pytest.fixture
async def tls_client(mtls_front: TlsFront, pki: Pki) -> AsyncIterator[Client]:
    yield await connect_with(
        settings(
            at(mtls_front),
            temporal_tls_ca=pki.ca,
            temporal_tls_cert=pki.client_cert,
            temporal_tls_key=pki.client_key,
            temporal_api_key=API_KEY,
        )
    )


def cli(
    system: System, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        env=env or system.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def test_a_replica_is_served_with_every_process_on_mtls(
    system: System, tls_client: Client, mtls_front: TlsFront, tiny: TinyModel
) -> None:
    spec = ModelSpec(name=MODEL, engine=EngineKind.LLAMA_CPP, source=str(tiny.model_path))
    key = system.catalog(spec)
    handshakes = mtls_front.handshakes.done
    base = (await system.start(tls_client, "tls-node", own_ports=True)).base
    replica_id = await replicas.start_replica(tls_client, spec)
    await replicas.wait_ready(tls_client, replica_id, 120)
    await wait_routable(base, key, MODEL)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{base}/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    # Control, agent and router each came in through the mTLS front.
    assert mtls_front.handshakes.done - handshakes >= 3

    status = cli(system, "status")
    assert status.returncode == 0, status.stderr
    assert replica_id in status.stdout

    plain = {k: v for k, v in system.env.items() if not k.startswith("LLMGW_TEMPORAL_TLS")}
    refused = cli(system, "status", env=plain)
    assert refused.returncode != 0
    assert "cannot connect to Temporal" in refused.stderr + refused.stdout
    assert "Traceback" not in refused.stderr

    # The API key went to every process and must not be in anything they wrote.
    for path in system.work_dir.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
