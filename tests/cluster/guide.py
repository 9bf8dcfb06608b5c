"""The cluster guide (docs/getting-started/cluster.md), read as the bed runs it.

The bed starts each process from the guide's own examples: the shared
environment file, each role's systemd unit (its ``EnvironmentFile=``,
``Environment=``, ``ExecStart=`` and ``User=``) and the load balancer's
configuration. The guide's example values (``gpu-07``, ``10.0.1.7``,
``temporal.internal``...) are replaced by the bed's; a value of the guide
that no replacement covers fails the bring-up, so the guide cannot drift
from what was tested without a test saying so.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

GUIDE = Path(__file__).parents[2] / "docs" / "getting-started" / "cluster.md"

# The guide's example values that are placeholders: each must be replaced.
PLACEHOLDERS = (
    "temporal.internal",
    "db.internal",
    "/etc/llmgw/",
    "/var/lib/llmgw",
    "/opt/llmgw/",
    "/srv/",
    "gpu-07",
    "10.0.",
    "%H",
)


class GuideError(AssertionError):
    """The guide lacks what the bed reads from it, or has a value it cannot place."""


@dataclass(frozen=True)
class Unit:
    """A role's systemd unit, as far as the bed reads it (``[Service]``)."""

    role: str
    environment_files: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    exec_start: list[str] = field(default_factory=list)
    user: str | None = None


def _block_after(text: str, marker: str, lang: str) -> str:
    at = text.find(marker)
    if at < 0:
        raise GuideError(f"the cluster guide no longer has {marker!r}")
    found = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, at)
    if found is None:
        raise GuideError(f"no ```{lang} block after {marker!r} in the cluster guide")
    return found.group(1)


def _assignments(lines: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for raw in lines.splitlines():
        line = raw.split("#", 1)[0].strip() if raw.lstrip().startswith("#") else raw.strip()
        if not line or "=" not in line:
            continue
        key, value = line.split("=", 1)
        out[key.strip()] = value.split("   #", 1)[0].strip()
    return out


def env_file(text: str | None = None) -> dict[str, str]:
    """The shared environment file ``/etc/llmgw/env``."""
    return _assignments(_block_after(text or GUIDE.read_text(), "`/etc/llmgw/env`", "sh"))


def unit(role: str, text: str | None = None) -> Unit:
    """The systemd unit of ``role`` (``control``, ``agent``, ``router``)."""
    body = _block_after(
        text or GUIDE.read_text(), f"(`/etc/systemd/system/llmgw-{role}.service`)", "ini"
    )
    section = ""
    files: list[str] = []
    env: dict[str, str] = {}
    exec_start: list[str] = []
    user: str | None = None
    for raw in body.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section != "[Service]":
            continue
        key, _, value = line.partition("=")
        value = value.split("   #", 1)[0].strip()
        if key == "EnvironmentFile":
            files.append(value)
        elif key == "Environment":
            name, _, setting = value.partition("=")
            env[name] = setting
        elif key == "ExecStart":
            exec_start = value.split()
        elif key == "User":
            user = value
    if not exec_start:
        raise GuideError(f"the guide's {role} unit has no ExecStart")
    return Unit(role, files, env, exec_start, user)


def read_env(path: Path) -> dict[str, str]:
    """A file of ``KEY=VALUE`` lines, as systemd's ``EnvironmentFile=`` reads it."""
    return _assignments(path.read_text())


def haproxy_config(text: str | None = None) -> str:
    """The load balancer's configuration (``/etc/haproxy/haproxy.cfg``)."""
    return _block_after(text or GUIDE.read_text(), "(`/etc/haproxy/haproxy.cfg`)", "haproxy")


def place(value: str, replacements: Mapping[str, str], where: str) -> str:
    """``value`` with the guide's example values replaced by the bed's; a
    placeholder left over is a guide the bed does not cover."""
    for example, real in sorted(replacements.items(), key=lambda kv: -len(kv[0])):
        value = value.replace(example, real)
    left = [p for p in PLACEHOLDERS if p in value]
    if left:
        raise GuideError(f"{where}: the bed has no value for the guide's {left} in {value!r}")
    return value
