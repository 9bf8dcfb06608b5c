"""The engine supervisor: start, find, watch and stop shard processes.

Which processes a shard has and what is recorded about them is here; how
one process is started (as whom, in which group) is ``worker_agent/spawn.py``.

Each shard runs in its own process group, because engines fork
workers that hold (GPU) memory and outlive a signal sent only to the leader.
For every shard a spec file records the shard, pid and a fingerprint (start
time + engine marker; not the command line, which a launcher's exec or a
process title changes) written atomically, so that a repeated launch - an
activity retried after the agent finished it but before Temporal heard -
finds the engine instead of starting a second one, and so that a restarted
agent can find engines it did not start.

What the agent writes here is private: shard dirs 0700, spec files and
engine logs 0600 (the engine writes its log through the descriptor it is
given, so it needs no access to the file). A spec file records the command
line with secrets redacted.
"""

import dataclasses
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import EngineLaunchError, EngineUserError
from llmgw.types import ShardRef
from worker_agent import procfs
from worker_agent.engines.spec import SLOTS_SUBDIR, redacted
from worker_agent.shard_record import RecordedFingerprint, ShardRecord, SpecFile
from worker_agent.spawn import Command, signal_group, spawn, user_for, wait_group_gone
from worker_agent.users import RunAs, own_dir_at

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 200
# Engine logs are trimmed past this size, keeping the newest part, so a
# chatty engine cannot fill the node's disk.
LOG_MAX_BYTES = 16 * 2**20
LOG_KEEP_BYTES = 2**20
# Set in every engine's environment to the agent's shard directory: it tells
# this agent's engines from any other process (another agent's on the same
# host included), so an engine whose spec file is gone can still be found.
ENGINE_MARKER = "LLMGW_ENGINE_OF"
# Set in every engine's environment to what its process title should say
# (which engine, which replica and rank), so an operator's ps tells them apart:
# the portable llama-server sets it (worker_agent/installs/portable_server.py,
# which names this variable itself: it imports nothing of llmgw).
TITLE_ENV = "LLMGW_ENGINE_TITLE"


def engine_title(ref: ShardRef, engine: str) -> str:
    """What an engine's process title says about it, e.g. ``llmgw llama.cpp replica r-1 rank 0``."""
    return f"llmgw {engine or 'engine'} replica {ref.replica_id} rank {ref.rank}"


def titled(command: Command, title: str) -> Command:
    """``command`` shown in ps as ``PROGRAM [TITLE] ARGS`` where that is safe.

    Only for a native program (an ELF file, not a Python interpreter): its
    argv[0] is just a name to it (llama-server and ggml-rpc-server find
    their libraries through /proc/self/exe). An interpreter derives
    ``sys.executable`` and its prefix from argv[0], so Python programs keep
    theirs and title themselves (the portable llama-server, from TITLE_ENV);
    a shell script's interpreter sees only its path.
    """
    program = Path(shutil.which(command.argv[0]) or command.argv[0]).resolve()
    try:
        with open(program, "rb") as fh:
            native = fh.read(4) == b"\x7fELF"
    except OSError:
        return command
    if not native or program.name.startswith("python"):
        return command
    return dataclasses.replace(command, title=f"{Path(command.argv[0]).name} [{title}]")


@dataclass(frozen=True)
class RunningShard:
    """A shard process the supervisor knows about."""

    ref: ShardRef
    pid: int
    port: int
    endpoint: str
    log_path: Path
    pgid: int = 0

    @property
    def group(self) -> int:
        """The process group holding every process of the shard."""
        return self.pgid or self.pid


@dataclass(frozen=True)
class StopOutcome:
    """What stopping a shard did."""

    was_running: bool
    exit_code: int | None


def shard_key(ref: ShardRef) -> str:
    """A filesystem-safe, unique name for a shard."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", ref.replica_id)
    return f"{safe}.r{ref.rank}"


class Supervisor:
    """Owns the shard processes of one node agent."""

    def __init__(
        self,
        work_dir: Path,
        node_id: str = "",
        run_as: RunAs | None = None,
        *,
        refusal: str = "",
        allow_root: bool = False,
        proxy: RunAs | None = None,
    ) -> None:
        """``run_as`` None: engines run as the agent's user. ``refusal``: every
        launch fails with it (the agent is root and has no usable engine
        user). ``allow_root``: a program the engine user cannot reach runs as
        the agent's user instead of failing the launch. ``proxy``: whom the
        pass-throughs become (``users.PROXY_USER``); None: ``run_as``."""
        self.node_id = node_id
        self.run_as = run_as
        self.proxy = proxy
        self.refusal = refusal
        self.allow_root = allow_root
        self.work_dir = work_dir
        self._dir = work_dir / "shards"
        _private_dir(self._dir)
        self.marker = str(self._dir.resolve())
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._sidecars: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._stopped: set[str] = set()

    def shard_dir(self, ref: ShardRef) -> Path:
        """Where a shard's spec and log live."""
        return self._dir / shard_key(ref)

    def _spec_path(self, ref: ShardRef) -> Path:
        return self.shard_dir(ref) / "spec.json"

    def _read_spec(self, ref: ShardRef) -> SpecFile | None:
        return SpecFile.load(self._spec_path(ref))

    def find_running(self, ref: ShardRef) -> RunningShard | None:
        """The live engine of a shard, matched by spec file and fingerprint."""
        spec = self._read_spec(ref)
        if spec is None:
            return None
        pid = spec.pid
        child = self._children.get(shard_key(ref))
        if child is not None and child.poll() is not None:
            return None
        # A child of ours that has not been reaped cannot have its pid reused:
        # no need to read /proc (which, right after exec, can show an empty
        # command line and made a healthy start look like a dead engine).
        ours = child is not None and child.pid == pid
        recorded = spec.fingerprint.model_dump() if spec.fingerprint else None
        marker = spec.fingerprint.marker if spec.fingerprint else None
        entry = f"{ENGINE_MARKER}={marker}" if marker else None
        if not ours and not procfs.same_process(pid, recorded, entry):
            return None
        return RunningShard(
            ref=ref,
            pid=pid,
            port=spec.port,
            endpoint=spec.endpoint,
            log_path=self.shard_dir(ref) / "engine.log",
            pgid=spec.group,
        )

    def recorded(self) -> list[ShardRef]:
        """Every shard a spec file records, running or not."""
        refs: list[ShardRef] = []
        for spec_file in sorted(self._dir.glob("*/spec.json")):
            spec = SpecFile.load(spec_file)
            if spec is None:
                log.warning("unreadable spec file %s", spec_file)
            else:
                refs.append(spec.shard)
        return refs

    def running(self) -> list[RunningShard]:
        """Every recorded shard whose engine is alive and identified."""
        return [r for ref in self.recorded() if (r := self.find_running(ref)) is not None]

    def used_ports(self) -> set[int]:
        """Ports recorded by shards that still run: published and engine-internal."""
        ports: set[int] = set()
        for r in self.running():
            ports.add(r.port)
            internal = self.plan_of(r.ref).internal_port
            if internal is not None:
                ports.add(internal)
        return ports

    def scratch_dir(self, ref: ShardRef) -> Path:
        """The shard's private TMPDIR and cache root, owned by whoever runs the engine.

        A fresh directory in the system temp dir rather than under the shard
        dir: vLLM puts ZeroMQ IPC sockets in TMPDIR, and a socket path has
        at most 107 bytes. Its path is kept in the shard dir, so a later agent
        removes it when the shard stops, with what engines leave in temp dirs
        (vLLM's ``vllm_dist_*``, torch's compile caches).

        Made anew for every launch, never reused: the engine user owns the
        old one and whatever is in it, and may have replaced it, or its
        ``tmp``, by a link to /etc, which a chown as root would follow. The
        new one is root's (mkdtemp: 0700, an unpredictable name) while its
        subdirectories are made and given away, and is given away last.
        """
        self._remove_scratch(ref)
        _private_dir(self.shard_dir(ref))
        root = Path(tempfile.mkdtemp(prefix="llmgw-"))
        (self.shard_dir(ref) / "scratch-path").write_text(str(root))
        uid, gid = (self.run_as.uid, self.run_as.gid) if self.run_as else (-1, -1)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for name in ("tmp", "cache", SLOTS_SUBDIR):
                os.close(own_dir_at(fd, name, uid, gid))
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
        return root

    def _remove_scratch(self, ref: ShardRef) -> None:
        """Remove the shard's scratch dir, or only the link the engine user left in
        its place (rmtree never follows links: it works through descriptors)."""
        pointer = self.shard_dir(ref) / "scratch-path"
        try:
            root = pointer.read_text().strip()
        except FileNotFoundError:
            return
        if root:
            try:
                if stat.S_ISDIR(os.lstat(root).st_mode):
                    shutil.rmtree(root, ignore_errors=True)
                else:
                    os.unlink(root)
            except OSError as exc:
                log.warning("cannot remove scratch dir %s: %s", root, exc)
        pointer.unlink(missing_ok=True)

    def kill_leftovers(self, ref: ShardRef) -> list[int]:
        """SIGKILL what is left of a shard whose engine exited: its group's other members.

        vLLM's EngineCore and workers (and the pass-through) outlive a leader
        killed by any hand, holding memory and the port. A process group id
        is not reused while any member lives, so a non-empty group with the
        recorded id is still this shard's.
        """
        spec = self._read_spec(ref)
        if spec is None:
            return []
        pgid = spec.group
        if procfs.group_reused(pgid, spec.leader_start):
            log.warning("shard %s: group %d gone, id reused: kept", shard_key(ref), pgid)
            return []
        members = procfs.group_members(pgid) if pgid > 0 else []
        if members:
            log.warning("shard %s: killing %d leftover processes", shard_key(ref), len(members))
            signal_group(pgid, signal.SIGKILL)
            wait_group_gone(pgid, self._children.get(shard_key(ref)), 10.0)
        return list(members)

    def engine_pids(self) -> set[int]:
        """Every live process in the groups of this node's running shards."""
        return {pid for r in self.running() for pid in procfs.group_members(r.group)}

    def forget_lost(self, ref: ShardRef) -> None:
        """Drop the spec of a shard whose engine is gone or was never ours."""
        self._spec_path(ref).unlink(missing_ok=True)

    def note_adopted(self, running: RunningShard) -> None:
        """Say in the shard's log that a new agent took it over."""
        with open(running.log_path, "a") as log_file:
            log_file.write(
                f"--- adopted by agent pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')};"
                " output the engine wrote while no agent watched is above ---\n"
            )

    def launch(
        self,
        ref: ShardRef,
        commands: Sequence[Command],
        port: int,
        endpoint: str,
        spec: ShardRecord,
        before_each: Callable[[int], None] | None = None,
    ) -> RunningShard:
        """Start a shard's commands in one new process group and record it.

        Every command but the last is a sidecar (a Ray head, say); the last
        is the engine, whose exit is the shard's. ``before_each(i)`` runs
        before command ``i`` starts (waiting for a rendezvous point); if it
        raises, what already started is killed, so a failed start leaves
        nothing behind.
        """
        if self.refusal:
            raise EngineUserError(self.refusal)
        users = [user_for(c, self.run_as, self.allow_root, self.proxy) for c in commands]
        shard_dir = self.shard_dir(ref)
        _private_dir(shard_dir)
        log_path = shard_dir / "engine.log"
        title = engine_title(ref, spec.engine)
        marker = {ENGINE_MARKER: self.marker, TITLE_ENV: title}
        commands = [titled(c, title) for c in commands]
        pgid: int | None = None
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for i, command in enumerate(commands):
                if before_each is not None:
                    before_each(i)
                procs.append(spawn(command, users[i], shard_dir, log_path, pgid, marker))
                pgid = pgid or procs[0].pid
        except BaseException:
            if pgid is not None:
                signal_group(pgid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
            raise
        main = procs[-1]
        assert pgid is not None
        self._children[shard_key(ref)] = main
        self._sidecars[shard_key(ref)] = procs[:-1]
        self._stopped.discard(shard_key(ref))
        record = SpecFile(
            shard=ref,
            pid=main.pid,
            pgid=pgid,
            port=port,
            endpoint=endpoint,
            # Identity is pid, start time and marker (procfs.matches). The
            # argv is kept for whoever reads the file, redacted: a key on
            # argv (SGLang's, with a custom launcher) must not be kept in a file.
            fingerprint=RecordedFingerprint(
                start_time=procfs.start_time(main.pid),
                cmdline=redacted(commands[-1].argv),
                marker=self.marker,
            ),
            spec=spec,
            group_start_time=procfs.start_time(pgid),
        )
        _write_atomic(self._spec_path(ref), record.model_dump_json(indent=2))
        log.info("shard %s started: pid %d group %d port %d", shard_key(ref), main.pid, pgid, port)
        return RunningShard(
            ref=ref, pid=main.pid, port=port, endpoint=endpoint, log_path=log_path, pgid=pgid
        )

    def plan_of(self, ref: ShardRef) -> ShardRecord:
        """What the launch recorded about the shard's plan (probe, HTTP or not);
        all defaults when there is no record."""
        spec = self._read_spec(ref)
        return spec.spec if spec is not None else ShardRecord()

    def dead_sidecar(self, ref: ShardRef) -> tuple[str, int] | None:
        """A sidecar (the pass-through, a Ray head) of this shard that has exited: argv0, code.

        For a shard this agent adopted (its sidecars are another agent's
        children), the first one, which leads the shard's group: gone, or its
        pid now another process's, once its recorded start time no longer
        matches. Its exit code is not known then: -1.
        """
        key = shard_key(ref)
        if key not in self._sidecars:
            spec = self._read_spec(ref)
            if spec is None or spec.group == spec.pid or spec.group_start_time is None:
                return None  # no sidecar, or a record from before leaders were kept
            leader = spec.group
            if procfs.start_time(leader) == spec.group_start_time and not (
                procfs.is_zombie_or_gone(leader)
            ):
                return None
            return f"sidecar (group leader {leader})", -1
        for sidecar in self._sidecars[key]:
            code = sidecar.poll()
            if code is not None:
                argv = [str(a) for a in sidecar.args]  # type: ignore[union-attr]
                # python [-I] -m MODULE: the module's name.
                m = argv.index("-m") if "-m" in argv[1:3] else 0
                name = argv[m + 1] if 0 < m < len(argv) - 1 else Path(argv[0]).name
                name = name.split(" [", 1)[0]  # a title's bracket (``titled``)
                return name, code
        return None

    def exit_code(self, ref: ShardRef) -> int | None:
        """The exit code of a shard that has exited and that this agent started."""
        child = self._children.get(shard_key(ref))
        return child.poll() if child is not None else None

    def log_tail(self, ref: ShardRef, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last lines the engine wrote."""
        path = self.shard_dir(ref) / "engine.log"
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, path.stat().st_size - 64 * 1024))
                tail = deque(fh.read().decode(errors="replace").splitlines(), maxlen=lines)
        except FileNotFoundError:
            return []
        return list(tail)

    def trim_log(self, ref: ShardRef, max_bytes: int = LOG_MAX_BYTES) -> bool:
        """Keep only the newest part of a log grown past ``max_bytes``.

        The engine writes with O_APPEND (the agent opened the file so), so
        truncating in place is safe: its next write lands at the new end.
        The older part goes to ``engine.log.1``, replacing the previous one.
        """
        path = self.shard_dir(ref) / "engine.log"
        try:
            size = path.stat().st_size
            if size <= max_bytes:
                return False
            with open(path, "r+b") as fh:
                fh.seek(size - LOG_KEEP_BYTES)
                newest = fh.read()
                older = os.open(
                    path.parent / "engine.log.1", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600
                )
                with os.fdopen(older, "wb") as out:
                    out.write(newest)
                fh.seek(0)
                fh.truncate(0)
                fh.write(b"--- log trimmed; the previous 1 MiB is in engine.log.1 ---\n")
        except OSError as exc:
            log.warning("cannot trim %s: %s", path, exc)
            return False
        return True

    def stop(self, ref: ShardRef, grace_s: float) -> StopOutcome:
        """Stop a shard's whole process group: SIGTERM, wait, SIGKILL, confirm.

        A no-op on a shard that is not running, so a retried stop is safe.
        """
        running = self.find_running(ref)
        child = self._children.get(shard_key(ref))
        if running is None:
            self.kill_leftovers(ref)
            self._forget(ref)
            return StopOutcome(was_running=False, exit_code=child.poll() if child else None)
        pgid = running.group
        signal_group(pgid, signal.SIGTERM)
        if not wait_group_gone(pgid, child, grace_s):
            log.warning("shard %s ignored SIGTERM for %.1fs: SIGKILL", shard_key(ref), grace_s)
            signal_group(pgid, signal.SIGKILL)
            if not wait_group_gone(pgid, child, 10.0):
                raise EngineLaunchError(f"shard {shard_key(ref)} survived SIGKILL (pgid {pgid})")
        code = child.poll() if child else None
        self._forget(ref)
        log.info("shard %s stopped (exit %s)", shard_key(ref), code)
        return StopOutcome(was_running=True, exit_code=code)

    def reap(self) -> None:
        """Collect the exit status of children that ended by any hand."""
        for child in self._children.values():
            child.poll()

    def stopped_on_request(self, ref: ShardRef) -> bool:
        """Whether this agent stopped the shard (rather than it exiting by itself)."""
        return shard_key(ref) in self._stopped

    def _forget(self, ref: ShardRef) -> None:
        self._stopped.add(shard_key(ref))
        self._children.pop(shard_key(ref), None)
        for sidecar in self._sidecars.pop(shard_key(ref), []):
            sidecar.poll()
        self._spec_path(ref).unlink(missing_ok=True)
        self._remove_scratch(ref)


def _private_dir(path: Path) -> None:
    """A directory only the agent's user can enter (created or tightened)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != 0o700:
        path.chmod(0o700)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
