"""Fixtures for the end-to-end tests: real processes, set up once per module
where the module's tests share what it serves."""

from collections.abc import Iterator

import pytest

from tests.harness import System, free_port


@pytest.fixture(scope="module")
def module_system(
    temporal_address: str, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[System]:
    """llmgw processes for a whole module, stopped after its last test.

    A module whose tests share one served replica (starting one takes most of
    a test's time) overrides ``system`` with this one."""
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    sys_ = System(temporal_address, tmp_path_factory.mktemp(name), free_port())
    yield sys_
    sys_.stop()
