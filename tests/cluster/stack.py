"""A whole llmgw cluster on a bed, brought up as the cluster guide says.

Hosts: ``temporal`` (the dev server and its UI), ``db`` (PostgreSQL),
``cp1``/``cp2`` (control workers), ``r1``/``r2`` (routers) behind HAProxy on
``lb``, and ``n1``... (node agents as root, engines as the engine user). The
test and the operator's CLI stay in the root namespace, which reaches every
host through the bridge, as an operator's machine reaches a cluster.

What the bed does that the guide does not, each for a reason:
- no TLS to Temporal (the dev server has none; tests/e2e/test_temporal_tls.py
  covers TLS): the env file's ``LLMGW_TEMPORAL_TLS_*`` lines are dropped;
- one engine cache for all the agents (``LLMGW_ENGINE_CACHE_DIR``), so llama.cpp
  is installed once, not once a node, and one engine thread each (2 cores);
- the guide's unit for the control worker and the router says ``User=llmgw``:
  the bed creates that user and runs them as it, unless the clone is out of its
  reach (under root's home), where they run as root and ``notes`` says so.
"""

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from llmgw_cli.dev.tinymodel import TinyModel
from tests.cluster import guide
from tests.cluster.hostproc import HostProcess
from tests.cluster.netbed import Bed
from tests.cluster.services import Haproxy, Postgres, Temporal, as_user, user_ids
from tests.harness import agents_engine_cache
from worker_agent.users import reachable

REPO = Path(__file__).parents[2]
NAMESPACE = "llmgw"
ROUTER_PORT = 8000  # the guide's LLMGW_PORT
LB_PORT = 80  # the guide's HAProxy bind
SERVICE_USER = "llmgw"
MODEL = "tiny"
# Settings the guide leaves at their defaults that a test shortens, so a
# scenario waits seconds, not minutes, for what it checks.
FASTER = {
    "LLMGW_ENGINE_THREADS": "1",
    "PYTHONFAULTHANDLER": "1",
}


def llmgw_bin() -> Path:
    """The ``llmgw`` console script of the venv the tests run in."""
    return Path(sys.executable).parent / "llmgw"


def _ensure_user(name: str) -> None:
    if subprocess.run(["id", name], capture_output=True, check=False).returncode == 0:
        return
    subprocess.run(
        ["useradd", "--system", "--user-group", "--no-create-home",
         "--shell", "/usr/sbin/nologin", name],
        check=True, capture_output=True,
    )  # fmt: skip


class Cluster:
    """The processes of a cluster on ``bed``; :meth:`close` stops them all."""

    def __init__(self, bed: Bed, files: Path, tiny: TinyModel, nodes: Sequence[str]) -> None:
        self.bed = bed
        self.files = files
        self.nodes = list(nodes)
        self.notes: list[str] = []
        self.admin_key = "admin-" + os.urandom(12).hex()
        self.api_key = ""  # a client key, once a scenario has made one
        self.models = files / "models"
        self.adapters = files / "adapters"
        for d in (self.models, self.adapters):
            d.mkdir(mode=0o755)
        self.model_path = self.models / "tiny.gguf"
        shutil.copy(tiny.model_path, self.model_path)
        self.model_path.chmod(0o644)
        self.temporal = Temporal(bed, "temporal", self._state("temporal"), NAMESPACE)
        self.pg = Postgres(bed, "db", self._state("db"))
        self.processes: dict[str, HostProcess] = {}
        self._guide = guide.GUIDE.read_text()
        _ensure_user(SERVICE_USER)
        self._service_user: str | None = SERVICE_USER
        uid, gid = user_ids(SERVICE_USER)
        if not reachable(llmgw_bin(), uid, [gid]) or not reachable(REPO, uid, [gid]):
            self._service_user = None
            self.notes.append(f"the clone is out of {SERVICE_USER}'s reach: services run as root")
        self.env_file = files / "env"
        self.admin_file = files / "router-admin-key"
        self.pgpass = {"service": files / "pgpass-llmgw", "root": files / "pgpass-root"}

    def _state(self, host: str) -> Path:
        place = self.files / host
        place.mkdir(mode=0o755, exist_ok=True)
        return place

    # Bring-up

    def start_services(self) -> None:
        """Temporal, PostgreSQL and the files every llmgw process reads."""
        self.temporal.start()
        self.pg.init()
        env = guide.env_file(self._guide)
        lines = [f"{k}={v}" for k, v in env.items() if not k.startswith("LLMGW_TEMPORAL_TLS")]
        self.env_file.write_text("\n".join(lines) + "\n")
        self.env_file.chmod(0o600)
        self.admin_file.write_text(f"LLMGW_ADMIN_KEY={self.admin_key}\n")
        self.admin_file.chmod(0o600)
        for who, path in self.pgpass.items():
            path.write_text(self.pg.passfile_line())
            path.chmod(0o600)
            if who == "service" and self._service_user:
                os.chown(path, *user_ids(self._service_user))

    def replacements(self, host: str, as_service: bool) -> dict[str, str]:
        """The bed's value for each of the guide's example values, on ``host``."""
        state = self._state(host) / "state"
        state.mkdir(mode=0o750, exist_ok=True)
        if as_service and self._service_user:
            os.chown(state, *user_ids(self._service_user))
        address = self.bed.address(host) if host in self.bed.hosts else self.bed.root_address
        return {
            "temporal.internal:7233": self.temporal.address,
            "db.internal": self.pg.address,
            "/etc/llmgw/pgpass": str(self.pgpass["service" if as_service else "root"]),
            "/etc/llmgw/env": str(self.env_file),
            "/etc/llmgw/router-admin-key": str(self.admin_file),
            "/var/lib/llmgw": str(state),
            "/opt/llmgw/.venv/bin/llmgw": str(llmgw_bin()),
            "/srv/models:/srv/adapters": f"{self.models}:{self.adapters}",
            "gpu-07": host,
            "10.0.0.10:80": f"{self.bed.address('lb')}:{LB_PORT}" if "lb" in self.bed.hosts else "",
            "10.0.1.7": address,
            "10.0.0.5": address,
            "%H": host,
        }

    def role_env(self, role: str, host: str) -> tuple[list[str], dict[str, str], str | None]:
        """The command, environment and user of ``role``'s unit on ``host``."""
        unit = guide.unit(role, self._guide)
        as_service = unit.user is not None
        places = self.replacements(host, as_service)
        env: dict[str, str] = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": places["/var/lib/llmgw"],
        }
        for name in unit.environment_files:
            read = guide.read_env(Path(guide.place(name, places, f"{role} EnvironmentFile")))
            env.update({k: guide.place(v, places, f"{role} {k}") for k, v in read.items()})
        env.update({k: guide.place(v, places, f"{role} {k}") for k, v in unit.environment.items()})
        env.update(FASTER)
        if role == "agent":
            env["LLMGW_ENGINE_CACHE_DIR"] = str(agents_engine_cache())
        argv = [guide.place(a, places, f"{role} ExecStart") for a in unit.exec_start]
        user = self._service_user if as_service else None
        if unit.user is not None and unit.user != SERVICE_USER:
            raise guide.GuideError(f"the {role} unit runs as {unit.user!r}, not {SERVICE_USER!r}")
        return argv, env, user

    def start_role(
        self, role: str, host: str, extra: Mapping[str, str] | None = None
    ) -> HostProcess:
        """Start ``role`` (``control``, ``agent``, ``router``) on ``host`` from its unit."""
        argv, env, user = self.role_env(role, host)
        env.update(extra or {})
        if user:
            argv = [*as_user(user), *argv]
        log = self.files / host / f"{role}-{len(self.bed.processes)}.log"
        proc = self.bed.start(host, argv, env=env, log=log)
        self.processes[host] = proc
        return proc

    def start_balancer(self, routers: Sequence[str]) -> Haproxy:
        """HAProxy on ``lb`` in front of ``routers``, from the guide's configuration."""
        first, second = routers
        places = {
            "10.0.0.10:80": f"{self.bed.address('lb')}:{LB_PORT}",
            "10.0.2.1": self.bed.address(first),
            "10.0.2.2": self.bed.address(second),
        }
        config = guide.place(guide.haproxy_config(self._guide), places, "haproxy.cfg")
        lb = Haproxy(self.bed, "lb", self._state("lb"), config, LB_PORT)
        lb.start()
        return lb

    def operator_env(self) -> dict[str, str]:
        """The environment of the operator's CLI (the root namespace): the env file."""
        places = self.replacements("operator", as_service=False)
        env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(self.files)}
        read = guide.read_env(self.env_file)
        env.update({k: guide.place(v, places, f"operator {k}") for k, v in read.items()})
        return env

    def cli(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """``llmgw ARGS`` as the operator runs it; its output captured."""
        return subprocess.run(
            [str(llmgw_bin()), *args],
            env=self.operator_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            cwd=self.files,
        )

    @property
    def base_url(self) -> str:
        """The OpenAI base URL clients use: the load balancer's."""
        return f"http://{self.bed.address('lb')}:{LB_PORT}/v1"

    def router_url(self, host: str) -> str:
        """One router's own base URL (past the load balancer)."""
        return f"http://{self.bed.address(host)}:{ROUTER_PORT}/v1"

    def close(self) -> None:
        """Stop every process (the bed's close kills what is left)."""
        for proc in reversed(list(self.processes.values())):
            proc.stop(grace_s=10)
        self.temporal.stop()
        self.pg.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
