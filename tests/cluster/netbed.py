"""A small cluster of hosts on this machine, built from network namespaces.

One private bridge in the root namespace; one namespace per host, each with
a veth into the bridge and an address from a /24 of 198.18.0.0/15 (reserved
for network tests, RFC 2544): hosts get ``.11``, ``.12``, ... in the order
given. The bridge holds ``.1``, so the root namespace (a test, or a process
the scenario keeps there) reaches the hosts too, and a host reaches the root
namespace at ``.1``. No namespace has a default route and the bridge has no
uplink: a host reaches nothing beyond the bed (connecting elsewhere fails at
once with ENETUNREACH).

Concurrent beds each take the first /24 (198.18.0.0/24, then 198.18.1.0/24,
...) whose ``.1`` no bridge holds yet, so their root-side routes never clash.

    with Bed.build(["a", "b"]) as bed:
        server = bed.start("a", [python, "-m", "http.server"], env=env)
        bed.cut_between("a", "b")
        ...

See :mod:`tests.cluster.names` for the naming and how leftovers are found.
"""

import fcntl
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from subprocess import CompletedProcess, run
from types import TracebackType

from llmgw_cli.procs import wait_for
from tests.cluster import links
from tests.cluster.hostproc import HostProcess, spawn
from tests.cluster.links import Host
from tests.cluster.names import (
    LOCK_DIR,
    bridge,
    files_dir,
    lock_path,
    namespace,
    new_bed_id,
    valid_host,
    veth,
)
from tests.cluster.sweep import remove_bed
from tests.cluster.system import BedError, root_addresses, sh

FIRST_HOST = 11


def _claim_subnet() -> int:
    """The third octet of the first 198.18.N.0/24 free in the root namespace.

    Called under the allocation lock, so two beds built at once differ.
    """
    held = set(root_addresses())
    for third in range(256):
        if f"198.18.{third}.1" not in held:
            return third
    raise BedError("no free /24 left in 198.18.0.0/16 for another test bed")


class Bed:
    """A bed of hosts, with the faults on them; torn down by :meth:`close`."""

    def __init__(self, bed_id: str, subnet: int, lock_fd: int, log_dir: Path | None) -> None:
        self.id = bed_id
        self.subnet = subnet
        self.bridge = bridge(bed_id)
        self.log_dir = log_dir
        self.hosts: dict[str, Host] = {}
        self.processes: list[HostProcess] = []
        self._lock_fd = lock_fd
        self._delayers: dict[str, HostProcess] = {}
        self._netem: bool | None = None

    @classmethod
    def build(cls, hosts: Iterable[str], log_dir: Path | None = None) -> "Bed":
        """Build a bed with ``hosts`` (short lowercase names).

        ``log_dir``: where :meth:`start` writes each process's output by default.
        """
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        bed_id = new_bed_id()
        # The owner's lock first: from here on a sweep sees this bed as live.
        lock_fd = os.open(lock_path(bed_id), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        alloc = os.open(LOCK_DIR / "subnets.mutex", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(alloc, fcntl.LOCK_EX)
            bed = cls(bed_id, _claim_subnet(), lock_fd, log_dir)
            try:
                bed.files.mkdir(mode=0o755)
                bed.files.chmod(0o755)  # whatever the umask
                sh("ip", "link", "add", bed.bridge, "type", "bridge")
                sh("ip", "addr", "add", f"{bed.address_of(1)}/24", "dev", bed.bridge)
                sh("ip", "link", "set", bed.bridge, "up")
            except BaseException:
                bed.close()
                raise
        finally:
            os.close(alloc)
        try:
            for name in hosts:
                bed.add_host(name)
        except BaseException:
            bed.close()
            raise
        return bed

    @property
    def files(self) -> Path:
        """The bed's own directory (0755), removed with the bed."""
        return files_dir(self.id)

    def address_of(self, last: int) -> str:
        """The address ``198.18.<subnet>.<last>`` of this bed."""
        return f"198.18.{self.subnet}.{last}"

    @property
    def root_address(self) -> str:
        """The root namespace's address in the bed (the bridge's)."""
        return self.address_of(1)

    def add_host(self, name: str) -> Host:
        """Add a host (its namespace, veth and the next address)."""
        if not valid_host(name) or name in self.hosts:
            raise BedError(f"bad or duplicate host name {name!r}")
        index = len(self.hosts)
        host = Host(
            name,
            namespace(self.id, name),
            self.address_of(FIRST_HOST + index),
            veth(self.id, index),
        )
        self.hosts[name] = host
        links.create(host, self.bridge, 24)
        return host

    def address(self, host: str) -> str:
        """The host's address."""
        return self.hosts[host].address

    # Processes

    def start(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None = None,
        log: Path | None = None,
    ) -> HostProcess:
        """Start ``argv`` on ``host`` in its own process group, with exactly ``env``.

        Output goes to ``log``, else to ``<log_dir>/<host>-<n>.log``, else nowhere.
        """
        if log is None and self.log_dir is not None:
            log = self.log_dir / f"{host}-{len(self.processes)}.log"
        proc = spawn(host, self.hosts[host].ns, argv, env, cwd, log)
        self.processes.append(proc)
        return proc

    def run(
        self, host: str, argv: Sequence[str], *, env: Mapping[str, str], timeout_s: float = 30
    ) -> CompletedProcess[str]:
        """Run a short command on ``host`` to its end; its output (not checked)."""
        return run(
            ["ip", "netns", "exec", self.hosts[host].ns, *argv],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    # Network faults, each one call and each undone by its pair

    def cut(self, host: str) -> None:
        """Cut ``host`` off from everything (its link down)."""
        links.cut(self.hosts[host])

    def heal(self, host: str) -> None:
        """Undo :meth:`cut`."""
        links.heal(self.hosts[host])

    def cut_between(self, host: str, peer: str) -> None:
        """Drop all traffic between ``host`` and ``peer``; both keep every other path."""
        links.cut_peer(self.hosts[host], self.address(peer))

    def heal_between(self, host: str, peer: str) -> None:
        """Undo :meth:`cut_between`."""
        links.heal_peer(self.hosts[host], self.address(peer))

    def netem(self, host: str, *, delay_ms: float = 0, loss_pct: float = 0) -> None:
        """Delay every packet on ``host``'s link by ``delay_ms`` each way (a round
        trip through it gains twice that) and lose ``loss_pct`` % each way.

        ``tc netem`` where the kernel has it; otherwise nftables for the loss
        and :mod:`tests.cluster.delayer` for the delay: the same round trips,
        though the whole added delay falls on packets coming in.
        """
        target = self.hosts[host]
        self.clear_netem(host)
        if self._netem is None:
            self._netem = links.has_netem(target)
        if self._netem:
            links.netem(target, delay_ms, loss_pct)
            return
        if loss_pct:
            links.loss_rules(target, loss_pct)
        if delay_ms:
            # Both ways' delay on the incoming side (see links.queue_rules).
            self._start_delayer(host, 2 * delay_ms)
            links.queue_rules(target)

    def clear_netem(self, host: str) -> None:
        """Undo :meth:`netem`."""
        target = self.hosts[host]
        links.clear_netem(target)
        links.clear_rules(target)
        delayer = self._delayers.pop(host, None)
        if delayer:
            delayer.stop(grace_s=1)

    def _start_delayer(self, host: str, delay_ms: float) -> None:
        out = (self.log_dir or Path("/tmp")) / f"{self.id}-{host}-delayer.log"
        out.unlink(missing_ok=True)
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[2])}
        proc = self.start(
            host,
            [sys.executable, "-m", "tests.cluster.delayer", links.DELAY_QUEUE, str(delay_ms)],
            env=env,
            log=out,
        )
        self._delayers[host] = proc

        # Bound before the rule is added: packets queued to no one would pass undelayed.
        def ended_or_ready() -> bool:
            return not proc.alive() or "ready" in (out.read_text() if out.exists() else "")

        if not wait_for(ended_or_ready, 10, interval_s=0.02) or not proc.alive():
            raise BedError(f"the delayer on {host} did not start: {out.read_text()}")

    # Teardown

    def close(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL), remove everything of the bed."""
        for proc in self.processes:
            proc.stop(grace_s=2)
        remove_bed(self.id)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> "Bed":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
