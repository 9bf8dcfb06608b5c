"""The few system commands the bed runs, and what it reads of the system."""

import json
import os
import subprocess
from collections.abc import Sequence

from tests.cluster.names import namespace, new_bed_id


class BedError(RuntimeError):
    """A command that builds, faults or tears down a bed failed."""


def sh(*argv: str, ns: str | None = None, check: bool = True) -> str:
    """Run a short command (in namespace ``ns``); its stdout.

    Raises BedError with the command's stderr when it fails and ``check``.
    """
    full: Sequence[str] = ["ip", "netns", "exec", ns, *argv] if ns else argv
    run = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    if check and run.returncode != 0:
        raise BedError(f"{' '.join(full)}: {run.stderr.strip() or run.returncode}")
    return run.stdout


def namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]


def links() -> list[str]:
    """Names of the links in the root namespace."""
    found: list[dict[str, str]] = json.loads(sh("ip", "-j", "link", "show") or "[]")
    return [link["ifname"] for link in found]


def namespace_pids(ns: str) -> list[int]:
    """Pids of the processes in namespace ``ns`` (none if it is gone)."""
    return [int(pid) for pid in sh("ip", "netns", "pids", ns, check=False).split()]


def root_addresses() -> list[str]:
    """The IPv4 addresses held in the root namespace, as ``a.b.c.d``."""
    found: list[dict[str, list[dict[str, str]]]] = json.loads(
        sh("ip", "-j", "-4", "addr", "show") or "[]"
    )
    return [info["local"] for link in found for info in link.get("addr_info", [])]


def usable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if os.geteuid() != 0:
        return "the network test bed needs root (ip netns add)"
    # Only trying tells: a container may list namespaces but refuse to make one.
    probe = namespace(new_bed_id(), "probe")
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "exec", probe, "true")
    except (OSError, BedError) as exc:
        return f"ip netns is unusable here: {exc}"
    finally:
        sh("ip", "netns", "del", probe, check=False)
    return None
