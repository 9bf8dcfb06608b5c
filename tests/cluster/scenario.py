"""What the cluster scenarios share: bring-up, waits on the deployment, the
operator's CLI, and client traffic whose every request is recorded with its
start, end, outcome and the replica that served it."""

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from temporalio.client import Client

from llmgw import replicas
from llmgw.store import Store
from llmgw.temporal import connect
from llmgw.types import ReplicaPhase, ReplicaTimeouts
from llmgw_cli.dev.tinymodel import TinyModel
from tests.cluster.netbed import Bed
from tests.cluster.services import PG_PORT
from tests.cluster.stack import MODEL, NAMESPACE, Cluster
from tests.cluster.system import namespace_pids

NODES = ["n1", "n2", "n3", "n4"]
CONTROLS = ["cp1", "cp2"]
ROUTERS = ["r1", "r2"]
HOSTS = ["temporal", "db", *CONTROLS, *ROUTERS, "lb", *NODES]
REPLICAS = 4
# Which replica served: routers say so in tests (LLMGW_EXPOSE_REPLICA_HEADER).
REPLICA_HEADER = "x-llmgw-replica"


def keep_logs(files: Path, into: Path) -> None:
    """Copy every log of the bed's files into ``into`` (kept after the bed goes)."""
    for log in files.rglob("*.log"):
        if log.is_file():
            shutil.copyfile(log, into / "-".join(log.relative_to(files).parts))


@contextmanager
def cluster_up(
    tiny: TinyModel,
    logs: Path,
    agent_env: Callable[[Bed, str], Mapping[str, str]] | None = None,
) -> Iterator[Cluster]:
    """The whole cluster, up: Temporal, PostgreSQL, two control workers, four
    agents, two routers behind HAProxy; torn down after, its logs in ``logs``.

    ``agent_env``: extra settings of the agent on each node host, asked once
    the bed is built (its addresses are known only then)."""
    with Bed.build(HOSTS) as bed:
        try:
            with Cluster(bed, bed.files, tiny, NODES) as built:
                built.start_services()
                for host in CONTROLS:
                    built.start_role("control", host)
                for host in NODES:
                    built.start_role("agent", host, agent_env(bed, host) if agent_env else None)
                for host in ROUTERS:
                    built.start_role("router", host, {"LLMGW_EXPOSE_REPLICA_HEADER": "true"})
                built.start_balancer(ROUTERS)
                yield built
        finally:
            keep_logs(bed.files, logs)
            print(f"\ncluster logs: {logs}")


def ok(done: subprocess.CompletedProcess[str]) -> str:
    """The command's output, once it is known to have succeeded."""
    assert done.returncode == 0, f"{done.args}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


async def client_of(cluster: Cluster) -> Client:
    """A Temporal client in the cluster's namespace, from the root namespace."""
    return await connect(cluster.temporal.address, NAMESPACE)


def deploy(cluster: Cluster, replicas_: int = REPLICAS, *, start: bool = True) -> str:
    """The model in the catalog with ``replicas_``, deployed (``model apply
    --deploy``; only written with ``start`` False), and a client key for it
    (made once); the key."""
    catalog = cluster.files / "catalog.yaml"
    catalog.write_text(
        "models:\n"
        f"  - name: {MODEL}\n"
        "    engine: llama.cpp\n"
        f"    source: {cluster.model_path}\n"
        f"    replicas: {replicas_}\n"
    )
    ok(cluster.cli("model", "apply", str(catalog), *(["--deploy"] if start else [])))
    if not cluster.api_key:
        made = ok(cluster.cli("keys", "create", "team-a", "--models", MODEL, "--rpm", "6000"))
        cluster.api_key = made.strip().splitlines()[-1]
    return cluster.api_key


async def deploy_with(
    cluster: Cluster, client: Client, timeouts: ReplicaTimeouts, replicas_: int = REPLICAS
) -> str:
    """``deploy``, the deployment started through the SDK with ``timeouts``
    (an operator's model job may set them; the catalog's ``--deploy`` takes
    the defaults): the catalog's own entry, so the reconcile pass leaves it be."""
    key = deploy(cluster, replicas_, start=False)
    store = Store(f"postgresql://llmgw:{cluster.pg.password}@{cluster.pg.address}:{PG_PORT}/llmgw")
    try:
        spec = (await asyncio.to_thread(store.catalog))[MODEL]
    finally:
        store.close()
    await replicas.apply_deployment(client, spec, replicas_, timeouts=timeouts)
    return key


async def serving(
    client: Client, want: int, timeout_s: float, model: str = MODEL
) -> dict[str, str]:
    """Replica id -> node of ``model``'s replicas, once exactly ``want`` serve."""
    async with asyncio.timeout(timeout_s):
        while True:
            status = await replicas.deployment_status(client, model)
            live = [s for s in status.slots if s.replica_id and not s.next_start_at]
            memos = [await replicas.replica_memo(client, s.replica_id) for s in live]
            ready = [m for m in memos if m is not None and m.phase is ReplicaPhase.READY]
            # The node from each replica's own memo: a slot's node_id may
            # still be its previous replica's for a moment.
            if len(live) == len(status.slots) == len(ready) == status.desired == want:
                return {m.replica_id: m.node_id for m in ready}
            await asyncio.sleep(0.5)


async def routable(
    cluster: Cluster, timeout_s: float = 60, model: str = MODEL, api_key: str = ""
) -> None:
    """Wait until a completion of ``model`` goes through the load balancer
    (routers learn a replica on a poll), with ``api_key`` or the cluster's."""
    key = api_key or cluster.api_key
    oai = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=key, max_retries=0)
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await oai.completions.create(model=model, prompt="hi", max_tokens=1)
                    return
                except openai.APIError:
                    await asyncio.sleep(0.5)
    finally:
        await oai.close()


def served_by(cluster: Cluster, router: str) -> float:
    """Requests a router answered with 200, from its own /metrics."""
    r = httpx.get(
        cluster.router_url(router).removesuffix("/v1") + "/metrics",
        headers={"Authorization": f"Bearer {cluster.admin_key}"},
        timeout=10,
    )
    r.raise_for_status()
    total = 0.0
    for line in r.text.splitlines():
        if line.startswith("llmgw_requests_total{") and 'status="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Outcome:
    """One client request: when it ran, whether it succeeded, who served it."""

    started: float
    ended: float
    replica: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        """Whether the client saw it succeed."""
        return not self.error


@dataclass
class Traffic:
    """``workers`` clients, each sending completions one after another through
    the load balancer until stopped; every request's outcome is kept."""

    base_url: str
    api_key: str
    workers: int = 3
    max_tokens: int = 4
    pause_s: float = 0.05
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list["asyncio.Task[None]"] = field(default_factory=list)

    async def _one(self, http: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                r = await http.post(
                    "/completions",
                    json={"model": MODEL, "prompt": "the river", "max_tokens": self.max_tokens},
                )
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0:
                    self.outcomes.append(
                        Outcome(began, time.monotonic(), r.headers.get(REPLICA_HEADER, ""))
                    )
                else:
                    self.outcomes.append(
                        Outcome(began, time.monotonic(), error=f"{r.status_code} {r.text[:200]}")
                    )
            except httpx.HTTPError as exc:
                self.outcomes.append(Outcome(began, time.monotonic(), error=repr(exc)))
            await asyncio.sleep(self.pause_s)

    async def __aenter__(self) -> "Traffic":
        http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=httpx.Timeout(120, connect=5),
        )
        self._http = http
        self._tasks = [asyncio.create_task(self._one(http)) for _ in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    async def until(self, count: int, timeout_s: float = 60) -> None:
        """Wait until ``count`` more requests have succeeded."""
        want = len(self.succeeded()) + count
        async with asyncio.timeout(timeout_s):
            while len(self.succeeded()) < want:
                await asyncio.sleep(0.05)

    def succeeded(self) -> list[Outcome]:
        """The requests that succeeded, in the order they ended."""
        return [o for o in self.outcomes if o.ok]

    def failed(self) -> list[Outcome]:
        """The requests that failed."""
        return [o for o in self.outcomes if not o.ok]

    def started_after(self, at: float) -> Sequence[Outcome]:
        """The requests sent at or after ``at`` (monotonic)."""
        return [o for o in self.outcomes if o.started >= at]


# An engine process's title, from its environment: its replica and rank.
TITLE = re.compile(rb"LLMGW_ENGINE_TITLE=llmgw \S+ replica (\S+) rank (\d+)")


def engine_groups(cluster: Cluster, nodes: Sequence[str] = NODES) -> dict[str, dict[str, set[int]]]:
    """Node -> replica id -> the process groups of that replica's engines.

    Every process of a shard carries its title in its environment and leads
    or joins the shard's process group (worker_agent/supervisor.py).
    """
    found: dict[str, dict[str, set[int]]] = {}
    for node in nodes:
        groups: dict[str, set[int]] = {}
        for pid in namespace_pids(cluster.bed.hosts[node].ns):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if (m := TITLE.search(environ.replace(b"\0", b"\n"))) is None:
                continue
            # The process group is the 5th field, after the parenthesised name.
            pgid = int(stat.rsplit(")", 1)[1].split()[2])
            groups.setdefault(m.group(1).decode(), set()).add(pgid)
        found[node] = groups
    return found
