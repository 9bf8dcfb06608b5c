"""A host's link into the bridge, and the network faults on it.

Cut from everything: the root end of the veth goes down, so the host keeps
its address and sockets but no frame crosses (a pulled cable, not a crash).
Cut from one peer: an nftables set in the host's namespace whose members'
packets are dropped both ways. Delay and loss: ``tc netem`` on both ends of
the veth, so every packet crossing the link, either way, is delayed and may
be lost. Kernels built without ``sch_netem`` (this project's CI VMs) get the
same round trips from nftables (loss) and :mod:`tests.cluster.delayer`
behind an NFQUEUE rule (delay), see :func:`queue_rules`.
"""

import tempfile
from dataclasses import dataclass

from tests.cluster.system import BedError, sh

IFACE = "eth0"  # the host's end, inside its namespace
DELAY_QUEUE = "0"


@dataclass(frozen=True)
class Host:
    """A host of the bed: its name, namespace, address and root-side veth."""

    name: str
    ns: str
    address: str
    veth: str


def create(host: Host, bridge: str, prefix_len: int) -> None:
    """Make the host's namespace with loopback up and its veth into ``bridge``.

    No default route is added: the connected /24 is the host's whole world.
    """
    sh("ip", "netns", "add", host.ns)
    sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", IFACE, "netns", host.ns)
    sh("ip", "link", "set", host.veth, "master", bridge, "up")
    sh("ip", "-n", host.ns, "addr", "add", f"{host.address}/{prefix_len}", "dev", IFACE)
    sh("ip", "-n", host.ns, "link", "set", IFACE, "up")
    sh("ip", "-n", host.ns, "link", "set", "lo", "up")


def cut(host: Host) -> None:
    """Cut the host off from everything in the bed."""
    sh("ip", "link", "set", host.veth, "down")


def heal(host: Host) -> None:
    """Undo :func:`cut`."""
    sh("ip", "link", "set", host.veth, "up")


_PEER_TABLE = """
table inet llmgw_peers {
  set cut { type ipv4_addr; }
  chain input { type filter hook input priority 0; ip saddr @cut drop; }
  chain output { type filter hook output priority 0; ip daddr @cut drop; }
}
"""


def cut_peer(host: Host, peer_address: str) -> None:
    """Drop everything between ``host`` and ``peer_address``, both ways.

    Drop, not reject: a partition answers nothing, so clients see timeouts.
    """
    if "llmgw_peers" not in sh("nft", "list", "tables", ns=host.ns):
        _nft(host, _PEER_TABLE)
    sh("nft", "add", "element", "inet", "llmgw_peers", "cut", f"{{ {peer_address} }}", ns=host.ns)


def heal_peer(host: Host, peer_address: str) -> None:
    """Undo :func:`cut_peer` for that peer (others stay cut)."""
    sh(
        "nft",
        "delete",
        "element",
        "inet",
        "llmgw_peers",
        "cut",
        f"{{ {peer_address} }}",
        ns=host.ns,
    )


def _nft(host: Host, ruleset: str) -> None:
    # A ruleset file keeps the rules readable instead of one argv word per token.
    with tempfile.NamedTemporaryFile("w", suffix=".nft") as f:
        f.write(ruleset)
        f.flush()
        sh("nft", "-f", f.name, ns=host.ns)


def has_netem(host: Host) -> bool:
    """Whether this kernel has ``sch_netem`` (tried on the host's link)."""
    try:
        sh("tc", "qdisc", "add", "dev", host.veth, "root", "netem", "delay", "0ms")
    except BedError:
        return False
    sh("tc", "qdisc", "del", "dev", host.veth, "root")
    return True


def netem(host: Host, delay_ms: float, loss_pct: float) -> None:
    """``tc netem`` on both ends of the link (replacing what was set)."""
    spec = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
    sh("tc", "qdisc", "replace", "dev", host.veth, "root", *spec)
    sh("tc", "qdisc", "replace", "dev", IFACE, "root", *spec, ns=host.ns)


def clear_netem(host: Host) -> None:
    """Remove what :func:`netem` set (nothing if nothing was)."""
    sh("tc", "qdisc", "del", "dev", host.veth, "root", check=False)
    sh("tc", "qdisc", "del", "dev", IFACE, "root", check=False, ns=host.ns)


def loss_rules(host: Host, loss_pct: float) -> None:
    """Random loss of ``loss_pct`` % of the link's packets each way, by nftables."""
    per_10k = round(loss_pct * 100)
    # numgen's values are 0..9999, so a bound of 10000 does not parse: 100 % drops all.
    drop = "drop" if per_10k >= 10000 else f"numgen random mod 10000 < {per_10k} drop"
    hook = "type filter hook {} priority -10;"
    _nft(
        host,
        f"""
table inet llmgw_loss {{
  chain input {{ {hook.format("input")} iifname "{IFACE}" {drop}; }}
  chain output {{ {hook.format("output")} oifname "{IFACE}" {drop}; }}
}}
""",
    )


def queue_rules(host: Host) -> None:
    """Send the packets coming in over the link to the delayer's queue.

    Incoming only: a packet held on its way out still counts against its
    socket's send budget (TCP small queues), which throttled a bulk transfer
    to a few hundred kB/s; the delayer holds incoming ones for both ways'
    delay instead. ``--queue-bypass``: with no delayer bound, packets pass.
    """
    sh(
        "iptables", "-A", "INPUT", "-i", IFACE, "-j", "NFQUEUE",
        "--queue-num", DELAY_QUEUE, "--queue-bypass", ns=host.ns,
    )  # fmt: skip


def clear_rules(host: Host) -> None:
    """Remove what :func:`loss_rules` and :func:`queue_rules` set."""
    sh("nft", "delete", "table", "inet", "llmgw_loss", ns=host.ns, check=False)
    for chain in ("INPUT", "OUTPUT"):
        sh("iptables", "-F", chain, ns=host.ns, check=False)
