"""InfiniBand / RoCE discovery over recorded sysfs trees, and the management interface."""

import errno
import ipaddress
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.types import FabricKind, Gid, LinkLayer
from tests.harness import FIXTURES
from worker_agent.fabric import (
    discover_fabric,
    discover_rdma,
    ipv4_of_gid,
    local_ipv4_addresses,
    management_interface,
    roce_v2_ipv4_gid_index,
)

SYSFS = FIXTURES / "sysfs"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
INTERFACES = {"lo": ["127.0.0.1"], "eno1": ["10.0.0.5"], "ens1f0np0": ["10.0.1.11"]}


def _copy(name: str, tmp_path: Path) -> Path:
    """A writable copy of a recorded tree."""
    return Path(shutil.copytree(SYSFS / name, tmp_path / name))


def _write(path: Path, value: str) -> None:
    """Write a sysfs attribute as the kernel prints it: value and newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value + "\n")


def test_ib_8x_ndr() -> None:
    ports = discover_rdma(SYSFS / "ib-8x-ndr")
    assert [p.device for p in ports] == [f"mlx5_{i}" for i in range(8)]
    for p in ports:
        assert (p.port, p.state, p.phys_state) == (1, "ACTIVE", "LinkUp")
        assert p.rate_gbps == 400.0
        assert p.link_layer is LinkLayer.INFINIBAND
        assert p.netdev == ""
        # Only the port GUID's link-local GID: the all-zero entry 1 is skipped.
        assert [(g.index, g.type) for g in p.gids] == [(0, "IB/RoCE v1")]
        assert p.gids[0].gid.startswith("fe80:0000:0000:0000:")
        assert p.roce_v2_ipv4_gid_index is None
    assert ports[0].gids[0].gid == "fe80:0000:0000:0000:946d:ae03:00f8:1c20"

    fabric = discover_fabric(SYSFS / "ib-8x-ndr", "10.0.0.5", INTERFACES)
    assert fabric.kind is FabricKind.INFINIBAND
    assert fabric.ports == ports
    assert fabric.management_interface == "eno1"
    assert fabric.management_address == "10.0.0.5"
    assert fabric.island == "fabric:infiniband"


def test_roce_2x() -> None:
    ports = discover_rdma(SYSFS / "roce-2x")
    assert [(p.device, p.netdev) for p in ports] == [
        ("mlx5_0", "ens1f0np0"),
        ("mlx5_1", "ens1f1np1"),
    ]
    for p in ports:
        assert p.state == "ACTIVE" and p.rate_gbps == 200.0
        assert p.link_layer is LinkLayer.ETHERNET
        assert [(g.index, g.type) for g in p.gids] == [
            (0, "IB/RoCE v1"),
            (1, "RoCE v2"),
            (2, "IB/RoCE v1"),
            (3, "RoCE v2"),
        ]
        assert {g.netdev for g in p.gids} == {p.netdev}
        # Not 0 (NCCL's usual default, v1 link-local) nor 1 (v2 but link-local).
        assert p.roce_v2_ipv4_gid_index == 3
    assert ipv4_of_gid(ports[0].gids[3].gid) == "10.0.1.11"
    assert ipv4_of_gid(ports[1].gids[3].gid) == "10.0.2.11"

    fabric = discover_fabric(SYSFS / "roce-2x", "10.0.0.5", INTERFACES)
    assert fabric.kind is FabricKind.ROCE
    assert fabric.island == "fabric:roce"


def test_roce_netdev_from_pci_device_without_ndevs(tmp_path: Path) -> None:
    root = _copy("roce-2x", tmp_path)
    for ndevs in root.glob("class/infiniband/*/ports/1/gid_attrs/ndevs"):
        shutil.rmtree(ndevs)
    ports = discover_rdma(root)
    assert [p.netdev for p in ports] == ["ens1f0np0", "ens1f1np1"]
    assert all(g.netdev == "" for p in ports for g in p.gids)
    assert [p.roce_v2_ipv4_gid_index for p in ports] == [3, 3]


def test_roce_v2_gid_on_the_port_netdev_beats_a_vlan(tmp_path: Path) -> None:
    root = _copy("roce-2x", tmp_path)
    port = root / "class/infiniband/mlx5_0/ports/1"
    # Entries 2-3 now belong to a VLAN on top of the port; 4-5 to the port itself.
    for index in (2, 3):
        _write(port / f"gids/{index}", "0000:0000:0000:0000:0000:ffff:0a64:000b")
        _write(port / f"gid_attrs/ndevs/{index}", "ens1f0np0.100")
    for index, gid_type in ((4, "IB/RoCE v1"), (5, "RoCE v2")):
        _write(port / f"gids/{index}", "0000:0000:0000:0000:0000:ffff:0a00:010b")
        _write(port / f"gid_attrs/types/{index}", gid_type)
        _write(port / f"gid_attrs/ndevs/{index}", "ens1f0np0")
    first = discover_rdma(root)[0]
    assert first.netdev == "ens1f0np0"
    assert first.roce_v2_ipv4_gid_index == 5


def test_roce_v2_choice_rules() -> None:
    def gid(index: int, value: str, gid_type: str, netdev: str) -> Gid:
        return Gid(index=index, gid=value, type=gid_type, netdev=netdev)

    v4 = "0000:0000:0000:0000:0000:ffff:0a00:010b"
    link_local = "fe80:0000:0000:0000:ba3f:d2ff:fe12:3456"
    gids = [
        gid(0, link_local, "IB/RoCE v1", "eth2"),
        gid(1, link_local, "RoCE v2", "eth2"),
        gid(2, v4, "IB/RoCE v1", "eth2"),
        gid(3, v4, "RoCE v2", "eth2.100"),
        gid(6, v4, "RoCE v2", "eth2"),
        gid(7, v4, "RoCE v2", "eth2"),
    ]
    assert roce_v2_ipv4_gid_index(gids, "eth2") == 6
    assert roce_v2_ipv4_gid_index(gids) == 3  # no netdev known: lowest index
    assert roce_v2_ipv4_gid_index(gids, "eth9") == 3
    assert roce_v2_ipv4_gid_index(gids[:3], "eth2") is None


def test_ipv4_of_gid() -> None:
    assert ipv4_of_gid("0000:0000:0000:0000:0000:ffff:0a00:010b") == "10.0.1.11"
    assert ipv4_of_gid("0000:0000:0000:0000:0000:ffff:c0a8:0001\n") == "192.168.0.1"
    assert ipv4_of_gid("::ffff:10.0.0.1") == "10.0.0.1"
    assert ipv4_of_gid("fe80:0000:0000:0000:ba3f:d2ff:fe12:3456") is None
    assert ipv4_of_gid(ZERO_GID) is None
    assert ipv4_of_gid("not a gid") is None


def test_mixed_down_only_active_ports_decide() -> None:
    ports = discover_rdma(SYSFS / "mixed-down")
    assert [(p.device, p.state, p.phys_state, p.rate_gbps) for p in ports] == [
        ("mlx5_0", "ACTIVE", "LinkUp", 400.0),
        ("mlx5_1", "DOWN", "Polling", 10.0),
    ]
    fabric = discover_fabric(SYSFS / "mixed-down", "10.0.0.5", INTERFACES)
    assert fabric.kind is FabricKind.INFINIBAND
    assert len(fabric.ports) == 2


def test_all_ports_down_is_a_single_node_island(tmp_path: Path) -> None:
    root = _copy("mixed-down", tmp_path)
    _write(root / "class/infiniband/mlx5_0/ports/1/state", "1: DOWN")
    fabric = discover_fabric(root, "10.0.0.5", INTERFACES, island="pod-a")
    assert fabric.kind is FabricKind.NONE
    assert [p.state for p in fabric.ports] == ["DOWN", "DOWN"]
    # A caller's island names a fabric; without one the node stands alone.
    assert fabric.island == "node:10.0.0.5"


def test_down_ethernet_port_does_not_make_infiniband_node_roce(tmp_path: Path) -> None:
    root = _copy("mixed-down", tmp_path)
    _write(root / "class/infiniband/mlx5_1/ports/1/link_layer", "Ethernet")
    assert discover_fabric(root, "10.0.0.5", INTERFACES).kind is FabricKind.INFINIBAND
    _write(root / "class/infiniband/mlx5_0/ports/1/state", "1: DOWN")
    _write(root / "class/infiniband/mlx5_1/ports/1/state", "4: ACTIVE")
    assert discover_fabric(root, "10.0.0.5", INTERFACES).kind is FabricKind.ROCE


def test_no_infiniband_class() -> None:
    assert discover_rdma(SYSFS / "none") == []
    fabric = discover_fabric(SYSFS / "none", "10.0.0.5", INTERFACES)
    assert fabric.kind is FabricKind.NONE
    assert fabric.ports == []
    assert fabric.island == "node:10.0.0.5"
    assert fabric.management_interface == "eno1"
    unnamed = discover_fabric(SYSFS / "none", "", INTERFACES)
    assert unnamed.island == f"node:{socket.gethostname()}"
    assert unnamed.management_interface == ""


def test_missing_sys_root(tmp_path: Path) -> None:
    assert discover_rdma(tmp_path / "absent") == []


def test_caller_island_for_a_fabric_node() -> None:
    fabric = discover_fabric(SYSFS / "ib-8x-ndr", "10.0.0.5", INTERFACES, island="ib:pod-a")
    assert fabric.island == "ib:pod-a"


@pytest.mark.parametrize(
    ("rate", "gbps"),
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("100 Gb/sec (4X EDR)", 100.0),
        ("25 Gb/sec (1X EDR)", 25.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("garbage", 0.0),
    ],
)
def test_rate_formats(tmp_path: Path, rate: str, gbps: float) -> None:
    root = _copy("mixed-down", tmp_path)
    _write(root / "class/infiniband/mlx5_0/ports/1/rate", rate)
    assert discover_rdma(root)[0].rate_gbps == gbps


def _failing_reads(monkeypatch: pytest.MonkeyPatch, failing: Callable[[Path], bool]) -> None:
    """Make reads of the matching paths fail with EINVAL, as real sysfs does."""
    original = Path.read_text

    def read_text(self: Path) -> str:
        if failing(self):
            raise OSError(errno.EINVAL, "Invalid argument", str(self))
        return original(self)

    monkeypatch.setattr(Path, "read_text", read_text)


def test_gid_type_read_error_is_tolerated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _copy("roce-2x", tmp_path)
    port = root / "class/infiniband/mlx5_0/ports/1"
    # Real sysfs has a type file for every entry; an unused one fails to read.
    _write(port / "gid_attrs/types/4", "")
    _failing_reads(monkeypatch, lambda p: p == port / "gid_attrs/types/4")
    assert [g.index for g in discover_rdma(root)[0].gids] == [0, 1, 2, 3]

    # A used entry whose type cannot be read has no type, so it is never chosen.
    _failing_reads(monkeypatch, lambda p: p.parent.name == "types" and p.name in {"3", "4"})
    first = discover_rdma(root)[0]
    assert first.gids[3].type == ""
    assert first.roce_v2_ipv4_gid_index is None


def test_ndev_read_error_falls_back_to_pci_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _copy("roce-2x", tmp_path)
    _failing_reads(monkeypatch, lambda p: p.parent.name == "ndevs")
    assert [p.netdev for p in discover_rdma(root)] == ["ens1f0np0", "ens1f1np1"]


def test_symlinked_layout_like_real_sys(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    pci = root / "devices/pci0000:00/0000:00:01.0/0000:01:00.0"
    device = pci / "infiniband/mlx5_0"
    shutil.copytree(SYSFS / "roce-2x/class/infiniband/mlx5_0/ports", device / "ports")
    # No ndevs: the netdev must be found through the device/ symlink.
    shutil.rmtree(device / "ports/1/gid_attrs/ndevs")
    _write(pci / "net/ens1f0np0/address", "b8:3f:d2:12:34:56")
    os.symlink("../../../0000:01:00.0", device / "device")
    (root / "class/infiniband").mkdir(parents=True)
    link = root / "class/infiniband/mlx5_0"
    os.symlink("../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/infiniband/mlx5_0", link)
    # A device that vanished between listing and reading (hot unplug): skipped.
    os.symlink(
        "../../devices/pci0000:00/0000:00:02.0/0000:02:00.0/infiniband/mlx5_1",
        link.parent / "mlx5_1",
    )
    assert link.is_symlink() and (link / "device").is_symlink()

    ports = discover_rdma(root)
    assert [(p.device, p.state, p.link_layer) for p in ports] == [
        ("mlx5_0", "ACTIVE", LinkLayer.ETHERNET)
    ]
    assert ports[0].netdev == "ens1f0np0"
    assert ports[0].roce_v2_ipv4_gid_index == 3
    assert discover_fabric(root, "10.0.1.11", INTERFACES).management_interface == "ens1f0np0"


def test_management_interface_choice() -> None:
    interfaces = {
        "lo": ["127.0.0.1"],
        "eno1": ["10.0.0.5"],
        "bond0": ["192.168.10.7", "192.168.11.7"],
        "ib0": ["172.16.0.5"],
    }
    assert management_interface("10.0.0.5", interfaces) == "eno1"
    assert management_interface("192.168.11.7", interfaces) == "bond0"
    assert management_interface(" 172.16.0.5 ", interfaces) == "ib0"
    assert management_interface("127.0.0.1", interfaces) == "lo"
    assert management_interface("10.9.9.9", interfaces) == ""
    assert management_interface("", interfaces) == ""


def test_local_ipv4_addresses_on_this_machine() -> None:
    found = local_ipv4_addresses()
    assert "127.0.0.1" in found["lo"]
    for addresses in found.values():
        assert addresses
        for address in addresses:
            assert isinstance(ipaddress.ip_address(address), ipaddress.IPv4Address)
    assert management_interface("127.0.0.1", found) == "lo"


def test_discover_fabric_uses_this_machines_interfaces_by_default() -> None:
    fabric = discover_fabric(SYSFS / "none", "127.0.0.1")
    assert fabric.management_interface == "lo"
    assert fabric.island == "node:127.0.0.1"
