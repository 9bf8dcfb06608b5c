"""Weights and LoRA adapters are read only inside the weights roots
(LLMGW_WEIGHTS_ROOTS), with every symlink resolved: real files and links."""

import os
from pathlib import Path

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.agent.adapters import AdapterActivities
from llmgw.settings import AgentSettings
from llmgw.types import AdapterCall
from worker_agent.adapter_service import AdapterService
from worker_agent.supervisor import Supervisor
from worker_agent.weights import (
    ROOTS_SETTING,
    Roots,
    SourceOutsideRoots,
    WeightsCache,
    WeightsError,
)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's disk: a weights root with a model, and a secret outside it."""
    (tmp_path / "models" / "llama").mkdir(parents=True)
    (tmp_path / "models" / "llama" / "config.json").write_text("{}")
    (tmp_path / "models" / "llama" / "model.safetensors").write_bytes(os.urandom(4096))
    (tmp_path / "models" / "tiny.gguf").write_bytes(b"GGUF" + os.urandom(100))
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "shadow").write_text("root:$6$secret")
    return tmp_path


def cache(node: Path) -> WeightsCache:
    return WeightsCache(node / "cache", [node / "models"])


def refused(node: Path, uri: str) -> SourceOutsideRoots:
    with pytest.raises(SourceOutsideRoots) as raised:
        cache(node).fetch(uri)
    # Fails the replica for good, saying which setting allows it.
    assert isinstance(raised.value, WeightsError) and not raised.value.retryable
    assert ROOTS_SETTING in str(raised.value)
    assert not any((node / "cache").glob("*/*")), "nothing may be copied"
    return raised.value


def test_sources_inside_the_roots_are_fetched(node: Path) -> None:
    assert cache(node).fetch(str(node / "models" / "tiny.gguf")).size_bytes == 104
    assert cache(node).fetch((node / "models" / "llama").as_uri()).size_bytes == 4098
    # A link inside the roots to a file inside them is fine (HF snapshots are links).
    (node / "models" / "alias.gguf").symlink_to(node / "models" / "tiny.gguf")
    assert cache(node).fetch(str(node / "models" / "alias.gguf")).size_bytes == 104


def test_a_path_outside_the_roots_is_refused(node: Path) -> None:
    error = refused(node, str(node / "private" / "shadow"))
    assert str(node / "models") in str(error)
    refused(node, (node / "private" / "shadow").as_uri())
    refused(node, str(node / "private"))
    # ".." does not climb out either.
    refused(node, str(node / "models" / ".." / "private" / "shadow"))
    # A root that merely shares a prefix with the path is not its parent.
    (node / "models-old").mkdir()
    (node / "models-old" / "x.gguf").write_bytes(b"x")
    refused(node, str(node / "models-old" / "x.gguf"))


def test_a_symlink_inside_a_root_pointing_out_is_refused(node: Path) -> None:
    (node / "models" / "evil.gguf").symlink_to(node / "private" / "shadow")
    error = refused(node, str(node / "models" / "evil.gguf"))
    assert str(node / "private" / "shadow") in str(error)
    refused(node, (node / "models" / "evil.gguf").as_uri())
    # A whole directory linked in from outside.
    (node / "models" / "outside").symlink_to(node / "private")
    refused(node, str(node / "models" / "outside"))


def test_a_model_directory_holding_a_link_out_is_refused(node: Path) -> None:
    (node / "models" / "llama" / "tokenizer.json").symlink_to(node / "private" / "shadow")
    error = refused(node, str(node / "models" / "llama"))
    assert "tokenizer.json" in str(error)
    os.unlink(node / "models" / "llama" / "tokenizer.json")
    (node / "models" / "llama" / "sub").symlink_to(node / "private")
    refused(node, (node / "models" / "llama").as_uri())


def test_a_cached_copy_is_not_served_once_the_roots_exclude_its_source(node: Path) -> None:
    source = str(node / "models" / "tiny.gguf")
    assert not WeightsCache(node / "cache", [node]).fetch(source).cached
    with pytest.raises(SourceOutsideRoots):
        WeightsCache(node / "cache", [node / "private"]).fetch(source)


def test_a_link_swapped_in_after_the_check_is_caught_at_open(node: Path) -> None:
    """The copy checks where each open landed, not the path checked earlier."""
    roots = Roots.of([node / "models"])
    target = node / "models" / "tiny.gguf"
    roots.inside(target)
    target.unlink()
    target.symlink_to(node / "private" / "shadow")
    with pytest.raises(SourceOutsideRoots):
        roots.open(target)
    with roots.open(node / "models" / "llama" / "config.json") as ok:
        assert ok.read() == b"{}"


def test_roots_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert AgentSettings(work_dir=tmp_path).resolved_weights_roots() == [tmp_path / "models"]
    monkeypatch.setenv(ROOTS_SETTING, f"/srv/models{os.pathsep}/data/hf")
    assert AgentSettings().resolved_weights_roots() == [Path("/srv/models"), Path("/data/hf")]
    monkeypatch.setenv(ROOTS_SETTING, '["/srv/a b"]')
    assert AgentSettings().resolved_weights_roots() == [Path("/srv/a b")]


async def test_adapters_are_loaded_only_from_inside_the_roots(node: Path) -> None:
    (node / "models" / "sql").mkdir()
    (node / "models" / "sneaky").symlink_to(node / "private")
    async with httpx.AsyncClient() as http:
        acts = AdapterActivities(
            AdapterService(Supervisor(node / "agent"), lambda _: "key", http, [node / "models"])
        )
        for path in (node / "private", node / "models" / "sneaky", node / "private" / "none"):
            call = AdapterCall(replica_id="r1", name="x", path=str(path))
            with pytest.raises(ApplicationError) as raised:
                await ActivityEnvironment().run(acts.load_adapter, call)
            assert raised.value.type == "AdapterOutsideRoots" and raised.value.non_retryable
            assert ROOTS_SETTING in str(raised.value)
        # Inside: it gets as far as looking for the replica's engine.
        call = AdapterCall(replica_id="r1", name="sql", path=str(node / "models" / "sql"))
        with pytest.raises(ApplicationError) as raised:
            await ActivityEnvironment().run(acts.load_adapter, call)
        assert raised.value.type == "EngineGone"
