"""NCCL / Gloo environment of multi-node shards, from recorded sysfs trees.

The variables follow the NCCL user guide's "Environment Variables" page
(``CHECKED_AGAINST["nccl"]``): exact-match (``=``) lists, since plain entries
are prefixes and ``mlx5_1`` would also select ``mlx5_10``.
"""

import shutil
from pathlib import Path

import pytest

from llmgw.types import EngineKind, FabricKind, LinkLayer, ModelSpec, NodeInventory, RdmaPort
from tests.harness import FIXTURES
from worker_agent.engines import (
    CHECKED_AGAINST,
    EngineProfile,
    LaunchValidationError,
    NodeFacts,
    Rendezvous,
    ShardRequest,
    chosen_ports,
    fabric_env,
    gpu_env,
    ib_hca,
    node_facts,
    plan_shard,
)
from worker_agent.fabric import discover_fabric, discover_rdma
from worker_agent.gpus import RecordedSource, discover

SYSFS = FIXTURES / "sysfs"
GPUS = FIXTURES / "gpus"
OWNED = ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_DISABLE")


def facts(tree: str, iface: str = "eno1", address: str = "10.0.0.5") -> NodeFacts:
    """A node whose RDMA ports are a recorded sysfs tree."""
    ports = discover_rdma(SYSFS / tree)
    kind = discover_fabric(SYSFS / tree, address, {iface: [address]}).kind
    return NodeFacts(
        host=address,
        advertise_address=address,
        management_interface=iface,
        fabric=kind,
        rdma_ports=tuple(ports),
        gpu_indices=(0, 1),
    )


def test_checked_against_nccl_docs() -> None:
    assert "Environment Variables" in CHECKED_AGAINST["nccl"]


def test_infiniband_8x_ndr() -> None:
    env = fabric_env(facts("ib-8x-ndr"))
    assert env == {
        "NCCL_SOCKET_IFNAME": "=eno1",
        "GLOO_SOCKET_IFNAME": "eno1",
        "NCCL_IB_HCA": "=" + ",".join(f"mlx5_{i}:1" for i in range(8)),
    }
    # InfiniBand addresses by LID: no GID index, and RDMA stays enabled.
    assert "NCCL_IB_GID_INDEX" not in env and "NCCL_IB_DISABLE" not in env


def test_roce_gets_the_v2_ipv4_gid_index() -> None:
    env = fabric_env(facts("roce-2x"))
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"
    # Index 3 is the routable RoCE v2 IPv4 entry; 0 (NCCL's usual pick) is v1 link-local.
    assert env["NCCL_IB_GID_INDEX"] == "3"
    assert env["NCCL_SOCKET_IFNAME"] == "=eno1"


def test_roce_ports_that_disagree_on_the_gid_index_are_refused() -> None:
    node = facts("roce-2x")
    second = node.rdma_ports[1].model_copy(update={"roce_v2_ipv4_gid_index": 5})
    node = node.model_copy(update={"rdma_ports": (node.rdma_ports[0], second)})
    with pytest.raises(LaunchValidationError, match=r"mlx5_0=3, mlx5_1=5"):
        fabric_env(node)


def test_roce_port_without_ipv4_v2_gid_is_refused() -> None:
    node = facts("roce-2x")
    bare = node.rdma_ports[0].model_copy(update={"roce_v2_ipv4_gid_index": None})
    node = node.model_copy(update={"rdma_ports": (bare, node.rdma_ports[1])})
    with pytest.raises(LaunchValidationError, match="mlx5_0 have no RoCE v2 GID"):
        fabric_env(node)


def test_down_port_is_left_out() -> None:
    node = facts("mixed-down")
    assert [p.state for p in node.rdma_ports] == ["ACTIVE", "DOWN"]
    assert fabric_env(node)["NCCL_IB_HCA"] == "=mlx5_0:1"


def test_other_link_layer_is_left_out(tmp_path: Path) -> None:
    """An active Ethernet (storage) port on an InfiniBand node is not NCCL's to use."""
    root = Path(shutil.copytree(SYSFS / "mixed-down", tmp_path / "t"))
    port = root / "class/infiniband/mlx5_1/ports/1"
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    ports = discover_rdma(root)
    assert {p.link_layer for p in ports if p.state == "ACTIVE"} == {
        LinkLayer.INFINIBAND,
        LinkLayer.ETHERNET,
    }
    chosen = chosen_ports(FabricKind.INFINIBAND, ports)
    assert [p.device for p in chosen] == ["mlx5_0"]
    assert ib_hca(chosen) == "=mlx5_0:1"


def test_no_fabric_disables_ib_only_when_opted_in() -> None:
    node = facts("none")
    assert node.fabric is FabricKind.NONE
    with pytest.raises(LaunchValidationError, match="allow_tcp"):
        fabric_env(node)
    assert fabric_env(node, allow_tcp=True) == {
        "NCCL_SOCKET_IFNAME": "=eno1",
        "GLOO_SOCKET_IFNAME": "eno1",
        "NCCL_IB_DISABLE": "1",
    }


def test_fabric_without_active_port_is_refused() -> None:
    node = facts("ib-8x-ndr")
    down = tuple(p.model_copy(update={"state": "DOWN"}) for p in node.rdma_ports)
    with pytest.raises(LaunchValidationError, match="no active infiniband port"):
        fabric_env(node.model_copy(update={"rdma_ports": down}))


def test_missing_management_interface_is_refused() -> None:
    with pytest.raises(LaunchValidationError, match="no management interface"):
        fabric_env(facts("ib-8x-ndr", iface=""))


def test_two_node_plan_uses_each_nodes_own_interface() -> None:
    """The bug the history records: one interface name for every node."""
    model = ModelSpec(name="m", engine=EngineKind.VLLM, source="/models/m", gpus=8)
    profile = EngineProfile(tp=8, pp=2, nodes=2)
    rdv = Rendezvous(leader_address="10.0.0.5", leader_port=29501)
    nodes = [facts("ib-8x-ndr", "eno1", "10.0.0.5"), facts("ib-8x-ndr", "enp3s0f0", "10.0.0.6")]
    envs = [
        plan_shard(
            ShardRequest(model=model, profile=profile, rank=r, node=n, rendezvous=rdv), "k", {}
        ).env
        for r, n in enumerate(nodes)
    ]
    assert [e["NCCL_SOCKET_IFNAME"] for e in envs] == ["=eno1", "=enp3s0f0"]
    assert [e["GLOO_SOCKET_IFNAME"] for e in envs] == ["eno1", "enp3s0f0"]
    assert [e["VLLM_HOST_IP"] for e in envs] == ["10.0.0.5", "10.0.0.6"]


def test_single_node_plan_sets_no_fabric_variables() -> None:
    model = ModelSpec(name="m", engine=EngineKind.VLLM, source="/models/m", gpus=2)
    node = facts("ib-8x-ndr")
    env = plan_shard(ShardRequest(model=model, profile=EngineProfile(tp=2), node=node), "", {}).env
    assert not {*OWNED, "NCCL_SOCKET_IFNAME", "VLLM_HOST_IP"} & env.keys()


def test_inherited_fabric_variables_do_not_leak() -> None:
    """An agent started with NCCL settings for another fabric must not pass them on."""
    model = ModelSpec(name="m", engine=EngineKind.VLLM, source="/models/m", gpus=2)
    inherited = {"NCCL_IB_HCA": "mlx5", "NCCL_IB_GID_INDEX": "0", "CUDA_VISIBLE_DEVICES": "7"}
    req = ShardRequest(model=model, profile=EngineProfile(tp=2), node=facts("roce-2x"))
    env = plan_shard(req, "", {**inherited, "PATH": "/usr/bin"}).env
    assert env["PATH"] == "/usr/bin"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "NCCL_IB_HCA" not in env and "NCCL_IB_GID_INDEX" not in env


def test_gpu_env_numbers_gpus_as_nvml_does() -> None:
    assert gpu_env([2, 3]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert gpu_env([])["CUDA_VISIBLE_DEVICES"] == ""


def test_node_facts_from_inventory() -> None:
    fabric = discover_fabric(SYSFS / "mixed-down", "10.0.0.5", {"eno1": ["10.0.0.5"]})
    gpus = discover(RecordedSource(GPUS / "8xH100-SXM.json").snapshot(), range(48213, 48221))
    inventory = NodeInventory(
        node_id="n1",
        hostname="n1",
        address="10.0.0.5",
        cpu_count=64,
        memory_mib=1 << 20,
        gpus=gpus,
        fabric=fabric,
    )
    node = node_facts(inventory, [4, 5], http_port=8001)
    assert (node.host, node.http_port, node.management_interface) == ("10.0.0.5", 8001, "eno1")
    assert node.fabric is FabricKind.INFINIBAND
    assert [p.device for p in node.rdma_ports] == ["mlx5_0"]  # the DOWN port is dropped
    assert [g.index for g in node.gpus] == [4, 5]
    assert {g.gpu_class for g in node.gpus} == {"h100-80g"}


def test_ports_are_plain_models() -> None:
    """RdmaPort objects built by hand (as a fixture would) work like discovered ones."""
    port = RdmaPort(
        device="mlx5_10",
        port=1,
        state="ACTIVE",
        link_layer=LinkLayer.ETHERNET,
        roce_v2_ipv4_gid_index=7,
    )
    node = NodeFacts(
        host="10.0.0.9", management_interface="bond0", fabric=FabricKind.ROCE, rdma_ports=(port,)
    )
    env = fabric_env(node)
    assert (env["NCCL_IB_HCA"], env["NCCL_IB_GID_INDEX"]) == ("=mlx5_10:1", "7")
