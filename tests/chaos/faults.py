"""The faults of a randomized run: each one call to inject and one to heal,
drawn from a seeded generator so that a seed replays the same schedule.

Which client failures a fault may explain is part of its kind
(``Fault.explains``): a router killed, or a node cut off, explains the
requests in flight when it struck; Temporal or the store down, only work
that needs them (a Responses or batch call made meanwhile), never a chat
completion, whose hot path needs neither. The rule is looser than "in flight
on that router or node": a failed request does not say which router or
replica it reached (HAProxy picks the router; the replica header comes only
with an answer), so any request in flight at that moment is excused.
"""

import random
from dataclasses import dataclass, field
from enum import StrEnum

from tests.cluster.stack import Cluster


class Kind(StrEnum):
    """What a fault does."""

    KILL_AGENT = "kill-agent"  # SIGKILL; healed by starting it again (it adopts)
    FREEZE_AGENT = "freeze-agent"  # SIGSTOP; healed by SIGCONT
    KILL_ROUTER = "kill-router"  # SIGKILL; healed by starting it again
    KILL_CONTROL = "kill-control"  # SIGKILL of a control worker; started again
    CUT_NODE = "cut-node"  # the node's link down
    CUT_AGENT_TEMPORAL = "cut-agent-temporal"  # the node from Temporal only
    SLOW_NODE = "slow-node"  # latency and loss on the node's link
    RESTART_TEMPORAL = "restart-temporal"  # stopped, down a while, started on its data
    RESTART_STORE = "restart-store"  # PostgreSQL stopped, down a while, started
    FREEZE_TEMPORAL = "freeze-temporal"  # SIGSTOP of the dev server


# The request classes a fault may fail, and how: "inflight" only requests in
# flight when it struck; "window" any request overlapping it (and its grace).
INFLIGHT = "inflight"
WINDOW = "window"
JOBS = frozenset({"response", "batch"})
ALL = frozenset({"chat", "stream", "completion", *JOBS})

EXPLAINS: dict[Kind, tuple[str, frozenset[str]]] = {
    Kind.KILL_ROUTER: (INFLIGHT, ALL),
    Kind.CUT_NODE: (INFLIGHT, ALL),
    Kind.KILL_AGENT: (WINDOW, JOBS),
    Kind.FREEZE_AGENT: (WINDOW, JOBS),
    Kind.KILL_CONTROL: (WINDOW, JOBS),
    Kind.CUT_AGENT_TEMPORAL: (WINDOW, JOBS),
    Kind.SLOW_NODE: (WINDOW, JOBS),
    Kind.RESTART_TEMPORAL: (WINDOW, JOBS),
    Kind.RESTART_STORE: (WINDOW, JOBS),
    Kind.FREEZE_TEMPORAL: (WINDOW, JOBS),
}


@dataclass
class Fault:
    """One fault: its kind, its target host, when it struck and was healed."""

    kind: Kind
    host: str
    hold_s: float
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    struck_at: float = 0.0
    healed_at: float = 0.0
    recovered_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line for the report."""
        extra = (
            f" {self.delay_ms:.0f}ms/{self.loss_pct:.0f}%" if self.kind is Kind.SLOW_NODE else ""
        )
        return f"{self.kind.value} {self.host}{extra} for {self.hold_s:.1f}s"

    def explains(self, what: str, started: float, ended: float, grace_s: float) -> bool:
        """Whether this fault accounts for a failed request of class ``what``."""
        how, classes = EXPLAINS[self.kind]
        if what not in classes:
            return False
        if how == INFLIGHT:
            return started <= self.struck_at <= ended
        return started <= self.healed_at + grace_s and ended >= self.struck_at


def draw(rng: random.Random, nodes: list[str], routers: list[str], controls: list[str],
         max_hold_s: float) -> Fault:  # fmt: skip
    """The next fault, at random (kinds equally likely), held for a random time."""
    kind = rng.choice(list(Kind))
    hold = rng.uniform(3.0, max_hold_s)
    if kind in (Kind.KILL_AGENT, Kind.FREEZE_AGENT, Kind.CUT_NODE, Kind.CUT_AGENT_TEMPORAL):
        return Fault(kind, rng.choice(nodes), hold)
    if kind is Kind.SLOW_NODE:
        return Fault(kind, rng.choice(nodes), hold, rng.uniform(20, 200), rng.uniform(0, 5))
    if kind is Kind.KILL_ROUTER:
        return Fault(kind, rng.choice(routers), hold)
    if kind is Kind.KILL_CONTROL:
        return Fault(kind, rng.choice(controls), hold)
    host = "db" if kind is Kind.RESTART_STORE else "temporal"
    return Fault(kind, host, hold)


ROUTER_ENV = {"LLMGW_EXPOSE_REPLICA_HEADER": "true"}


def strike(cluster: Cluster, fault: Fault) -> None:
    """Inject ``fault``."""
    bed, host = cluster.bed, fault.host
    match fault.kind:
        case Kind.KILL_AGENT | Kind.KILL_ROUTER | Kind.KILL_CONTROL:
            cluster.processes[host].kill()
        case Kind.FREEZE_AGENT:
            cluster.processes[host].freeze()
        case Kind.CUT_NODE:
            bed.cut(host)
        case Kind.CUT_AGENT_TEMPORAL:
            bed.cut_between(host, "temporal")
        case Kind.SLOW_NODE:
            bed.netem(host, delay_ms=fault.delay_ms / 2, loss_pct=fault.loss_pct)
        case Kind.RESTART_TEMPORAL:
            cluster.temporal.stop()
        case Kind.RESTART_STORE:
            cluster.pg.stop()
        case Kind.FREEZE_TEMPORAL:
            assert cluster.temporal.proc is not None
            cluster.temporal.proc.freeze()


def heal(cluster: Cluster, fault: Fault) -> None:
    """Undo ``fault``: what was killed is started again, as its supervisor would."""
    bed, host = cluster.bed, fault.host
    match fault.kind:
        case Kind.KILL_AGENT:
            cluster.processes[host].popen.wait(10)
            cluster.start_role("agent", host)
        case Kind.KILL_ROUTER:
            cluster.processes[host].popen.wait(10)
            cluster.start_role("router", host, ROUTER_ENV)
        case Kind.KILL_CONTROL:
            cluster.processes[host].popen.wait(10)
            cluster.start_role("control", host)
        case Kind.FREEZE_AGENT:
            cluster.processes[host].thaw()
        case Kind.CUT_NODE:
            bed.heal(host)
        case Kind.CUT_AGENT_TEMPORAL:
            bed.heal_between(host, "temporal")
        case Kind.SLOW_NODE:
            bed.clear_netem(host)
        case Kind.RESTART_TEMPORAL:
            cluster.temporal.start()
        case Kind.RESTART_STORE:
            cluster.pg.start()
        case Kind.FREEZE_TEMPORAL:
            assert cluster.temporal.proc is not None
            cluster.temporal.proc.thaw()
