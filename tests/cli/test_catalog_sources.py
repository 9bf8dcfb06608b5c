"""`llmgw model apply`'s source check, against agents' weights reports (no processes)."""

from llmgw.catalog import parse_catalog
from llmgw.catalog_sources import UNKNOWN, check_sources, local_path, verdict
from llmgw.path_filter import OPAQUE, PathFilter
from llmgw.types import NodeInventory, WeightsEntry, WeightsReport

ROOT = "/srv/models"


def report(
    found: list[str], opaque: list[str], refused: dict[str, str], complete: bool = True
) -> WeightsReport:
    """A node's report, as an agent would make it of these paths under ROOT."""
    paths = PathFilter.for_paths(64)
    for path in [*found, *refused]:
        paths.add(f"{ROOT}/{path}")
    for path in opaque:
        paths.add(f"{OPAQUE}{ROOT}/{path}")
    return WeightsReport(
        roots=[ROOT],
        depth=2,
        complete=complete,
        found=paths.encode(),
        found_bits=paths.bits,
        refused=[
            WeightsEntry(path=f"{ROOT}/{p}", kind="file", problem=why) for p, why in refused.items()
        ],
    )


REPORT = report(
    found=["tiny.gguf", "org", "org/deep", "adapters", "adapters/a.gguf", "private"],
    opaque=["org/deep"],
    refused={"secret.gguf": "not readable by the agent", "locked": "not readable by the agent"},
)


def node(node_id: str, report: WeightsReport | None) -> NodeInventory:
    return NodeInventory(
        node_id=node_id, hostname=node_id, address="127.0.0.1", cpu_count=1, memory_mib=1,
        weights=report,
    )  # fmt: skip


def catalog(*sources: str) -> str:
    return "models:\n" + "".join(
        f"  - name: m{i}\n    source: {s}\n" for i, s in enumerate(sources)
    )


def test_verdicts() -> None:
    assert verdict(REPORT, f"{ROOT}/tiny.gguf") == ""
    assert verdict(REPORT, f"{ROOT}/secret.gguf") == "not readable by the agent"
    assert verdict(REPORT, f"{ROOT}/missing.gguf") == "does not exist"
    assert verdict(REPORT, f"{ROOT}/org/missing") == "does not exist"
    assert verdict(REPORT, f"{ROOT}/org/deep/model") is UNKNOWN  # not listed that deep
    assert verdict(REPORT, f"{ROOT}/tiny.gguf/x") == "does not exist"
    assert verdict(REPORT, f"{ROOT}/locked/m.gguf") == f"{ROOT}/locked not readable by the agent"
    outside = verdict(REPORT, "/x/*.gguf")
    assert outside is not None and outside.startswith("outside the weights roots (/srv/models")
    assert verdict(REPORT.model_copy(update={"complete": False}), f"{ROOT}/new.gguf") is UNKNOWN


def test_local_paths_only() -> None:
    assert local_path("file:///srv/models/a/../tiny.gguf") == ("/srv/models/tiny.gguf", "")
    assert "absolute path" in local_path("models/tiny.gguf")[1]
    assert local_path("hf://org/model") == ("", "hf:// is not a local path on the nodes")


def test_each_bad_source_is_refused_naming_its_field() -> None:
    entries = parse_catalog(
        catalog(f"{ROOT}/tiny.gguf", "/x/*.gguf", f"{ROOT}/missing.gguf", f"{ROOT}/secret.gguf")
    )
    found = check_sources(entries, {"a": node("a", REPORT)})
    assert [p.split(":", 1)[0] for p in found.problems] == [
        "models[1].source", "models[2].source", "models[3].source",
    ]  # fmt: skip
    outside = "/x/*.gguf cannot be read on any node (node a: outside the weights roots"
    assert outside in found.problems[0]
    assert "node a: does not exist" in found.problems[1]
    assert "node a: not readable by the agent" in found.problems[2]


def test_adapters_are_checked_too() -> None:
    text = (
        f"models:\n  - name: m\n    source: {ROOT}/tiny.gguf\n    adapters:\n"
        f"      - {{name: good, source: {ROOT}/adapters/a.gguf}}\n"
        f"      - {{name: bad, source: /home/me/b.gguf}}\n"
    )
    found = check_sources(parse_catalog(text), {"a": node("a", REPORT)})
    (problem,) = found.problems
    assert problem.startswith("models[0].adapters[1].source: /home/me/b.gguf cannot be read")


def test_one_node_that_can_serve_it_is_enough_and_the_others_are_noted() -> None:
    other = WeightsReport(roots=["/data"])
    found = check_sources(
        parse_catalog(catalog(f"{ROOT}/tiny.gguf")), {"a": node("a", REPORT), "b": node("b", other)}
    )
    assert found.problems == []
    (note,) = found.notes
    assert "not usable everywhere (node b: outside the weights roots" in note


def test_without_reports_nothing_is_refused_but_it_says_so() -> None:
    found = check_sources(parse_catalog(catalog("/anything.gguf")), {"old": node("old", None)})
    assert found.problems == []
    assert found.notes == [
        "sources not checked against the nodes: no agent has reported its weights roots"
    ]
    for source in ("hf://org/model/m.gguf", "s3://bucket/m.gguf", "modelscope://org/m"):
        pinned = check_sources(parse_catalog(catalog(source)), {})
        assert pinned.problems == []  # pinned against its Hub or store instead


def test_a_missing_path_says_how_old_the_report_is() -> None:
    entries = parse_catalog(catalog(f"{ROOT}/new.gguf"))
    found = check_sources(entries, {"a": node("a", REPORT)}, ages_s={"a": 12.4})
    assert "node a: does not exist (as reported 12s ago)" in found.problems[0]


def test_the_path_filter_never_forgets_and_rarely_imagines() -> None:
    paths = PathFilter.for_paths(1000)
    added = [f"/srv/models/m{i}.gguf" for i in range(1000)]
    for path in added:
        paths.add(path)
    again = PathFilter.decode(paths.encode(), paths.bits)
    assert all(p in again for p in added)
    imagined = sum(f"/srv/models/other{i}.gguf" in again for i in range(10_000))
    assert imagined < 300  # about 1% at capacity
