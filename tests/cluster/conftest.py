"""The bed fixtures: a sweep of leftover beds at session start, a bed a test,
a whole cluster a module."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.dev.tinymodel import TinyModel
from tests.cluster.netbed import Bed
from tests.cluster.scenario import cluster_up
from tests.cluster.stack import Cluster
from tests.cluster.sweep import sweep
from tests.cluster.system import usable


@pytest.fixture(scope="session", autouse=True)
def netns_ok() -> str | None:
    """Why the bed cannot be built here (not root, no ``ip netns``), or None.

    Also removes the beds a killed run left behind, before any test builds one.
    """
    reason = usable()
    if reason is None:
        sweep()
    return reason


@pytest.fixture
def bed(netns_ok: str | None, tmp_path: Path) -> Iterator[Bed]:
    """Hosts ``a``, ``b``, ``c``; torn down after the test, failed or not."""
    if netns_ok:
        pytest.skip(netns_ok)
    with Bed.build(["a", "b", "c"], log_dir=tmp_path) as built:
        yield built


@pytest.fixture(scope="module")
def cluster(
    netns_ok: str | None, tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A whole cluster for the module's scenarios (see tests.cluster.scenario)."""
    if netns_ok:
        pytest.skip(netns_ok)
    with cluster_up(tiny, tmp_path_factory.mktemp("cluster-logs")) as built:
        yield built
