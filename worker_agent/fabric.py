"""The node's high-speed fabric (InfiniBand / RoCE) from sysfs, and its management interface.

Everything is read from ``<sys_root>/class/infiniband`` so tests can point the
reader at recorded trees. On a real machine the entries under ``class/`` are
symlinks into ``devices/``; recorded trees may use plain directories. The
reader only uses operations that follow symlinks, so both work.

A node without ``class/infiniband`` (or without an active port) is not an
error: it is a single-node island.
"""

import errno
import fcntl
import ipaddress
import logging
import re
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from llmgw.types import FabricKind, Gid, LinkLayer, NodeFabric, RdmaPort

log = logging.getLogger(__name__)

SYS = Path("/sys")

ROCE_V2 = "RoCE v2"
_ACTIVE = "ACTIVE"
# SIOCGIFADDR from <linux/sockios.h>: the primary IPv4 address of an interface.
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16


def _read(path: Path) -> str | None:
    """A sysfs attribute without its trailing newline, or None when unreadable.

    Real sysfs fails reads of some attributes with EINVAL (the type of an
    unused GID entry, the ndev of an InfiniBand GID), so any OSError means
    "no value" rather than a broken node.
    """
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key putting mlx5_2 before mlx5_10 and gid 9 before gid 10."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def _entries(directory: Path) -> list[str]:
    """Names of the directory's entries in natural order; none if it is absent or unreadable."""
    try:
        names = [entry.name for entry in directory.iterdir()]
    except OSError:
        return []
    return sorted(names, key=_natural_key)


def _after_colon(value: str | None) -> str:
    """The name after the numeric code: "4: ACTIVE" -> "ACTIVE"; "" when absent."""
    if value is None:
        return ""
    return value.split(":", 1)[-1].strip()


def _rate_gbps(value: str | None) -> float:
    """Gb/sec as a float: "400 Gb/sec (4X NDR)" -> 400.0; 0.0 when unparsable."""
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec", value or "")
    return float(match.group(1)) if match else 0.0


def _is_zero_gid(gid: str) -> bool:
    """Unused GID table entries read as all zeros."""
    try:
        return ipaddress.IPv6Address(gid) == ipaddress.IPv6Address(0)
    except ValueError:
        return not gid.replace(":", "").strip("0")


def ipv4_of_gid(gid: str) -> str | None:
    """The IPv4 address inside an IPv4-mapped GID (``::ffff:a.b.c.d``), else None.

    >>> ipv4_of_gid("0000:0000:0000:0000:0000:ffff:0a00:010b")
    '10.0.1.11'
    """
    try:
        mapped = ipaddress.IPv6Address(gid.strip()).ipv4_mapped
    except ValueError:
        return None
    return str(mapped) if mapped is not None else None


def _read_gids(port_dir: Path) -> list[Gid]:
    """The used entries of a port's GID table, with type and net device when known."""
    gids: list[Gid] = []
    for name in _entries(port_dir / "gids"):
        if not name.isdigit():
            continue
        value = _read(port_dir / "gids" / name)
        if not value or _is_zero_gid(value):
            continue
        gids.append(
            Gid(
                index=int(name),
                gid=value,
                type=_read(port_dir / "gid_attrs" / "types" / name) or "",
                netdev=_read(port_dir / "gid_attrs" / "ndevs" / name) or "",
            )
        )
    return gids


def _netdev_from_device(device_dir: Path, port: int) -> str:
    """The net device listed under the adapter's PCI device (``<dev>/device/net``).

    mlx5 exposes one port per RDMA device, so there is one entry. A dual-port
    device (mlx4) lists one per port; ``dev_port`` (0-based) tells them apart.
    """
    names = _entries(device_dir / "device" / "net")
    if len(names) <= 1:
        return names[0] if names else ""
    for name in names:
        if _read(device_dir / "device" / "net" / name / "dev_port") == str(port - 1):
            return name
    return ""


def _port_netdev(device_dir: Path, port: int, gids: Sequence[Gid]) -> str:
    """The net device behind a RoCE port.

    The lowest used GID is the port's default GID, which the kernel binds to
    the port's own net device. It is preferred over ``device/net`` because a
    bonded (LAG) port's traffic and IP address are on the bond, which only the
    GID table names; ``device/net`` shows the first PF's netdev instead.
    """
    for gid in gids:
        if gid.netdev:
            return gid.netdev
    return _netdev_from_device(device_dir, port)


def roce_v2_ipv4_gid_index(gids: Iterable[Gid], netdev: str = "") -> int | None:
    """The GID index NCCL should use (NCCL_IB_GID_INDEX) on a RoCE port, or None.

    NCCL's default index is usually a v1 link-local entry, which does not
    route across subnets; the routable entry is a RoCE v2 GID carrying an IPv4
    address. Among several, the one on the port's own net device wins (others
    belong to VLANs or macvlans stacked on it), then the lowest index.
    """
    candidates = [g for g in gids if g.type == ROCE_V2 and ipv4_of_gid(g.gid) is not None]
    if not candidates:
        return None
    best = min(candidates, key=lambda g: (bool(netdev) and g.netdev != netdev, g.index))
    return best.index


def _read_port(device_dir: Path, port: int) -> RdmaPort | None:
    """One port of an RDMA device; None when its link layer is neither IB nor Ethernet."""
    port_dir = device_dir / "ports" / str(port)
    # Kernels before link_layer existed only supported InfiniBand.
    raw_layer = _read(port_dir / "link_layer") or LinkLayer.INFINIBAND.value
    try:
        layer = LinkLayer(raw_layer)
    except ValueError:
        log.debug("skipping %s port %d: link layer %r", device_dir.name, port, raw_layer)
        return None
    gids = _read_gids(port_dir)
    netdev = _port_netdev(device_dir, port, gids) if layer is LinkLayer.ETHERNET else ""
    return RdmaPort(
        device=device_dir.name,
        port=port,
        state=_after_colon(_read(port_dir / "state")),
        phys_state=_after_colon(_read(port_dir / "phys_state")),
        rate_gbps=_rate_gbps(_read(port_dir / "rate")),
        link_layer=layer,
        netdev=netdev,
        gids=gids,
        roce_v2_ipv4_gid_index=(
            roce_v2_ipv4_gid_index(gids, netdev) if layer is LinkLayer.ETHERNET else None
        ),
    )


def discover_rdma(sys_root: Path = SYS) -> list[RdmaPort]:
    """Every port of every RDMA device under ``<sys_root>/class/infiniband``, in natural order.

    An absent ``class/infiniband`` (no RDMA driver loaded) yields an empty list.
    """
    ports: list[RdmaPort] = []
    class_dir = sys_root / "class" / "infiniband"
    for device in _entries(class_dir):
        device_dir = class_dir / device
        for name in _entries(device_dir / "ports"):
            if not name.isdigit():
                continue
            port = _read_port(device_dir, int(name))
            if port is not None:
                ports.append(port)
    return ports


def fabric_kind(ports: Iterable[RdmaPort]) -> FabricKind:
    """INFINIBAND if any active port runs InfiniBand, ROCE if active ports are Ethernet.

    Down ports do not count: a cabled-but-dead adapter cannot carry traffic.
    """
    layers = {p.link_layer for p in ports if p.state == _ACTIVE}
    if LinkLayer.INFINIBAND in layers:
        return FabricKind.INFINIBAND
    if LinkLayer.ETHERNET in layers:
        return FabricKind.ROCE
    return FabricKind.NONE


def management_interface(address: str, interfaces: Mapping[str, Sequence[str]]) -> str:
    """The interface holding ``address`` (the agent's management address); "" if none does.

    Addresses are compared as IP addresses where they parse, so "10.0.0.5"
    matches however it is spelled. Names are scanned in natural order so the
    answer is stable should two interfaces hold the same address.
    """
    wanted = _canonical_ip(address)
    if not wanted:
        return ""
    for name in sorted(interfaces, key=_natural_key):
        if any(_canonical_ip(held) == wanted for held in interfaces[name]):
            return name
    return ""


def _canonical_ip(address: str) -> str:
    text = address.strip()
    try:
        return str(ipaddress.ip_address(text.split("%", 1)[0]))
    except ValueError:
        return text


def _ipv4_of_interface(sock: socket.socket, name: str) -> str | None:
    """The primary IPv4 address of one interface, or None when it has none."""
    request = struct.pack("256s", name.encode()[: _IFNAMSIZ - 1])
    try:
        reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
    except OSError as exc:
        # EADDRNOTAVAIL: up or down, the interface has no IPv4 address.
        if exc.errno not in (errno.EADDRNOTAVAIL, errno.ENODEV):
            log.debug("SIOCGIFADDR on %s failed: %s", name, exc)
        return None
    # struct ifreq: 16-byte name, then struct sockaddr_in (family, port, addr).
    return socket.inet_ntoa(reply[20:24])


def local_ipv4_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4 addresses, without running a subprocess.

    SIOCGIFADDR returns the primary address only: secondary addresses added
    with ``ip addr add`` without a label are not listed. Interfaces without
    IPv4 are left out.
    """
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            address = _ipv4_of_interface(sock, name)
            if address is not None:
                found[name] = [address]
    return found


def discover_fabric(
    sys_root: Path = SYS,
    management_address: str = "",
    interfaces: Mapping[str, Sequence[str]] | None = None,
    island: str | None = None,
) -> NodeFabric:
    """The node's fabric: RDMA ports, their kind, management interface and island.

    ``interfaces`` defaults to this machine's (``local_ipv4_addresses``).

    Islands: a node without an active RDMA port is its own island,
    ``node:<management address or hostname>``, whatever ``island`` says. A
    fabric node is in ``island`` when the caller knows it (configuration),
    else ``fabric:<kind>``, which puts every node of that kind together.
    Telling apart separate fabrics (by subnet manager or subnet prefix) is out
    of scope here.
    """
    ports = discover_rdma(sys_root)
    kind = fabric_kind(ports)
    if interfaces is None:
        interfaces = local_ipv4_addresses()
    if kind is FabricKind.NONE:
        where = management_address or socket.gethostname()
        island_id = f"node:{where}"
    else:
        island_id = island or f"fabric:{kind.value}"
    return NodeFabric(
        kind=kind,
        ports=ports,
        management_interface=management_interface(management_address, interfaces),
        management_address=management_address,
        island=island_id,
    )
