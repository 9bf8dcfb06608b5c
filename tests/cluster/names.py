"""How a bed's objects are named, so a sweep can find every one of them.

A bed has a random six-hex id. Its namespaces are ``llmgw-<id>-<host>``
(namespace names have no length limit); its links live in the root
namespace, where names are shared and at most 15 characters, so they are
``lgw<id>br`` (the bridge) and ``lgw<id>v<n>`` (host n's veth). Inside each
namespace the host's end is simply ``eth0``.

The owner of a live bed holds an exclusive ``flock`` on
``/run/llmgw-netbed/<id>.lock``: the kernel drops it when the owner dies,
however it dies, so a sweep can tell a leftover bed from a concurrent one
without trusting pids.
"""

import re
import secrets
from pathlib import Path

NS_PREFIX = "llmgw-"
LINK_PREFIX = "lgw"
LOCK_DIR = Path("/run/llmgw-netbed")
# Every process a bed starts carries this in its environment (value: its
# namespace), so it is found even after its namespace is gone.
MARKER = "LLMGW_NETBED_OF"

_NS = re.compile(r"^llmgw-([0-9a-f]{6})-[a-z0-9]+$")
_LINK = re.compile(r"^lgw([0-9a-f]{6})(br|v[0-9]+)$")


def new_bed_id() -> str:
    """A fresh random bed id."""
    return secrets.token_hex(3)


def namespace(bed_id: str, host: str) -> str:
    """The namespace of ``host`` in bed ``bed_id``."""
    return f"{NS_PREFIX}{bed_id}-{host}"


def bridge(bed_id: str) -> str:
    """The bed's bridge in the root namespace."""
    return f"{LINK_PREFIX}{bed_id}br"


def veth(bed_id: str, index: int) -> str:
    """The root-side end of host ``index``'s veth."""
    return f"{LINK_PREFIX}{bed_id}v{index}"


# Each bed's files (its services' data, logs, models): 0755, for the engine
# and service users, and removed with the bed.
FILES_ROOT = Path("/tmp")
FILES_PREFIX = "llmgw-bed-"


def files_dir(bed_id: str) -> Path:
    """Where the bed keeps its files."""
    return FILES_ROOT / f"{FILES_PREFIX}{bed_id}"


def lock_path(bed_id: str) -> Path:
    """The file the bed's owner holds locked while it lives."""
    return LOCK_DIR / f"{bed_id}.lock"


def bed_of_namespace(name: str) -> str | None:
    """The bed id in a namespace name, or None if it is no bed's."""
    match = _NS.match(name)
    return match.group(1) if match else None


def bed_of_link(name: str) -> str | None:
    """The bed id in a root-namespace link name, or None if it is no bed's."""
    match = _LINK.match(name)
    return match.group(1) if match else None


def valid_bed_id(text: str) -> bool:
    """Whether ``text`` has the shape of a bed id."""
    return re.fullmatch(r"[0-9a-f]{6}", text) is not None


def valid_host(host: str) -> bool:
    """Host names are short lowercase words: they end up in namespace names."""
    return re.fullmatch(r"[a-z][a-z0-9]{0,15}", host) is not None
