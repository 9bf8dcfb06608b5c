"""The test bed itself: addresses, isolation, each fault and its heal, teardown
and the sweep of a killed run's bed. Real sockets between real namespaces;
every wait is on a condition, with a bound."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llmgw_cli.procs import wait_for
from tests.cluster.hostproc import HostProcess
from tests.cluster.names import bed_of_link, bed_of_namespace, files_dir
from tests.cluster.netbed import Bed
from tests.cluster.sweep import marked_pids, owner_alive, sweep
from tests.cluster.system import links, namespaces, sh

PORT = 7000
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
REPO = Path(__file__).parents[2]

# Echoes each line back, one thread a connection.
ECHO = """
import socket, threading
srv = socket.create_server(("0.0.0.0", int(__import__("sys").argv[1])), backlog=64)
def serve(conn):
    with conn, conn.makefile("rb") as lines:
        for line in lines:
            conn.sendall(line)
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""

# Connects, sends N lines, prints "ok <least round trip in ms>" or the error.
PROBE = """
import errno, socket, sys, time
addr, port, timeout, n = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
try:
    with socket.create_connection((addr, port), timeout=timeout) as s, s.makefile("rb") as r:
        best = float("inf")
        for _ in range(n):
            t = time.monotonic(); s.sendall(b"x\\n"); assert r.readline() == b"x\\n"
            best = min(best, time.monotonic() - t)
        print("ok", best * 1000)
except TimeoutError:
    print("timeout")
except OSError as e:
    print(errno.errorcode.get(e.errno or 0, str(e)))
"""


def echo(bed: Bed, host: str) -> HostProcess:
    """An echo server on ``host``, once the root namespace can reach it."""
    proc = bed.start(host, [sys.executable, "-c", ECHO, str(PORT)], env=ENV)
    assert wait_for(lambda: probe(bed, "", bed.address(host)) == "ok", 10), host
    return proc


def probe_full(bed: Bed, source: str, address: str, timeout_s: float = 1, n: int = 1) -> str:
    """The probe's answer from host ``source`` ("": the root namespace)."""
    argv = [sys.executable, "-c", PROBE, address, str(PORT), str(timeout_s), str(n)]
    if source:
        out = bed.run(source, argv, env=ENV).stdout
    else:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30).stdout
    return out.strip()


def probe(bed: Bed, source: str, address: str, timeout_s: float = 1) -> str:
    """``ok`` if ``source`` got an echo from ``address``, else the error."""
    return probe_full(bed, source, address, timeout_s).split(" ")[0]


def rtt_ms(bed: Bed, source: str, target: str) -> float:
    """The least of 3 echo round trips from ``source`` to ``target``."""
    answer = probe_full(bed, source, bed.address(target), timeout_s=5, n=3).split()
    assert answer[0] == "ok", answer
    return float(answer[1])


def traces(bed_id: str) -> tuple[list[str], list[str], list[int], list[Path]]:
    """The namespaces, links, processes and files of bed ``bed_id`` on this machine."""
    return (
        [ns for ns in namespaces() if bed_of_namespace(ns) == bed_id],
        [name for name in links() if bed_of_link(name) == bed_id],
        marked_pids(bed_id),
        [files_dir(bed_id)] if files_dir(bed_id).exists() else [],
    )


def test_hosts_reach_each_other_and_nothing_outside(bed: Bed) -> None:
    echo(bed, "a")
    assert bed.address("a") == bed.address_of(11)
    assert probe(bed, "b", bed.address("a")) == "ok"
    assert probe(bed, "c", bed.address("a")) == "ok"
    # No default route: outside addresses fail at once, nothing waits on a timeout.
    for outside in ("10.255.255.1", "198.18.255.1", "8.8.8.8"):
        assert probe(bed, "a", outside, timeout_s=5) == "ENETUNREACH", outside
    assert "default" not in sh("ip", "route", "show", ns=bed.hosts["a"].ns)


def test_a_cut_host_is_unreachable_until_healed(bed: Bed) -> None:
    echo(bed, "a")
    bed.cut("a")
    assert probe(bed, "b", bed.address("a")) != "ok"
    assert probe(bed, "", bed.address("a")) != "ok"
    bed.heal("a")
    assert wait_for(lambda: probe(bed, "b", bed.address("a")) == "ok", 10)


def test_a_peer_cut_blocks_exactly_that_pair(bed: Bed) -> None:
    for host in ("a", "b", "c"):
        echo(bed, host)
    bed.cut_between("a", "b")
    assert probe(bed, "b", bed.address("a")) == "timeout"
    assert probe(bed, "a", bed.address("b")) == "timeout"
    for source, target in (("c", "a"), ("a", "c"), ("b", "c"), ("c", "b"), ("", "a")):
        assert probe(bed, source, bed.address(target)) == "ok", (source, target)
    bed.heal_between("a", "b")
    assert probe(bed, "b", bed.address("a")) == "ok"
    assert probe(bed, "a", bed.address("b")) == "ok"


def test_delay_adds_to_the_round_trip_and_loss_drops(bed: Bed) -> None:
    echo(bed, "a")
    bed.netem("b", delay_ms=40)
    # Each way through b's link: a round trip between b and anyone gains 80 ms.
    assert rtt_ms(bed, "b", "a") >= 80
    assert rtt_ms(bed, "c", "a") < rtt_ms(bed, "b", "a")
    bed.netem("b", loss_pct=100)
    assert probe(bed, "b", bed.address("a")) == "timeout"
    bed.clear_netem("b")
    assert probe(bed, "b", bed.address("a")) == "ok"
    ns = bed.hosts["b"].ns
    assert "netem" not in sh("tc", "qdisc", "show", ns=ns)
    assert "llmgw_loss" not in sh("nft", "list", "tables", ns=ns)
    assert "NFQUEUE" not in sh("iptables", "-S", ns=ns, check=False)


def test_a_frozen_process_answers_nothing_until_thawed(bed: Bed) -> None:
    server = echo(bed, "a")
    server.freeze()
    assert wait_for(lambda: _state(server.pid) == "T", 5)
    # The kernel still completes the handshake; the echo never comes.
    assert probe(bed, "b", bed.address("a")) == "timeout"
    server.thaw()
    assert probe(bed, "b", bed.address("a"), timeout_s=5) == "ok"
    server.kill()
    assert server.popen.wait(5) == -signal.SIGKILL
    assert probe(bed, "b", bed.address("a")) == "ECONNREFUSED"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_teardown_leaves_nothing_of_the_bed(netns_ok: str | None, tmp_path: Path) -> None:
    if netns_ok:
        pytest.skip(netns_ok)
    with Bed.build(["x", "y"], log_dir=tmp_path) as bed:
        echo(bed, "x")
        (bed.files / "state").write_text("kept until the bed goes")
        bed.start("y", ["sleep", "600"], env=ENV).freeze()
        bed.cut_between("x", "y")
        bed.netem("y", delay_ms=5)
        assert all(traces(bed.id))
    assert traces(bed.id) == ([], [], [], [])
    assert not owner_alive(bed.id)


OWNER = """
import sys
from tests.cluster.netbed import Bed
bed = Bed.build(["p", "q"])
bed.start("p", ["sleep", "600"], env={"PATH": "/usr/bin:/bin"})
print(bed.id, flush=True)
sys.stdin.read()
"""


def test_the_sweep_removes_the_bed_of_a_killed_owner(bed: Bed) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None and owner.stdin is not None
    with owner.stdin:
        left = owner.stdout.readline().strip()
        assert left and owner_alive(left)
        assert wait_for(lambda: len(traces(left)[2]) == 1, 5)
        # A live bed, this test's own, is no leftover.
        assert left not in sweep() and bed.id not in sweep()
        owner.kill()
        assert owner.wait(5) == -signal.SIGKILL
    owner.stdout.close()
    assert all(traces(left)) and not owner_alive(left)
    assert left in sweep()
    assert traces(left) == ([], [], [], [])
    assert all(traces(bed.id)[:2])  # untouched
    assert sweep() == []
