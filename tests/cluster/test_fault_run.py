"""The randomized fault run, short and seeded (issue 36 §3): a few faults of
every kind the seed draws, traffic throughout, and no violation allowed.
The full run is ``python -m tests.chaos --minutes 30``."""

from tests.chaos.run import fault_run
from tests.cluster.stack import Cluster

SEED = 36
MINUTES = 1.75
EVERY_S = 20.0


async def test_a_short_seeded_fault_run_breaks_no_invariant(cluster: Cluster) -> None:
    report = await fault_run(cluster, MINUTES, SEED, EVERY_S)
    print("\n" + report.text())
    assert len(report.faults) >= 4
    assert sum(report.succeeded.values()) > 0
    assert report.violations == []
