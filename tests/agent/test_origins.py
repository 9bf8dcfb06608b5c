"""A pin turned into the files a node fetches: at the pinned commit, from the
endpoint of the settings, the token a header read per request."""

import pytest

from llmgw.types.weights_manifest import DigestKind, ManifestFile, SourcePin, WeightsManifest
from worker_agent.origins import Origins, artifact_for
from worker_agent.weights import UnsupportedSource

COMMIT = "a" * 40


def pin(repo: str = "org/m") -> SourcePin:
    return SourcePin(
        scheme="hf",
        repo=repo,
        requested="main",
        revision=COMMIT,
        manifest=WeightsManifest(
            files=(
                ManifestFile(
                    path="config.json", size=3, digest="b" * 40, digest_kind=DigestKind.GIT_SHA1
                ),
                ManifestFile(path="sub/model.safetensors", size=9, digest="c" * 64),
            )
        ),
    )


def test_files_come_at_the_pinned_commit_with_their_digests() -> None:
    tokens = iter(["t1", "t2"])
    got = artifact_for("hf://org/m@main", pin(), Origins("http://hub:1/", lambda: next(tokens)))
    assert got.file is None  # a checkpoint: the engine gets the directory
    urls = [f.url for f in got.spec.files]
    assert urls == [
        f"http://hub:1/org/m/resolve/{COMMIT}/config.json",
        f"http://hub:1/org/m/resolve/{COMMIT}/sub/model.safetensors",
    ]
    first, second = got.spec.files
    assert (first.digest_kind, second.digest_kind) == (DigestKind.GIT_SHA1, DigestKind.SHA256)
    # Read at each request, so a rotated secret is used from the next one.
    assert first.headers() == {"Authorization": "Bearer t1"}
    assert second.headers() == {"Authorization": "Bearer t2"}
    assert "t1" not in repr(got)
    assert (
        Origins().hf_token() == ""
        and artifact_for("hf://org/m", pin(), Origins()).spec.files[0].headers() == {}
    )


def test_a_named_file_is_what_the_engine_gets() -> None:
    got = artifact_for("hf://org/m/sub/model.safetensors", pin(), Origins())
    assert got.file == "sub/model.safetensors"


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("hf://org/other", "pinned to another repo"),
        ("/srv/m.gguf", "not a remote source"),
    ],
)
def test_a_source_the_pin_does_not_fit_is_refused(source: str, why: str) -> None:
    with pytest.raises(UnsupportedSource, match=why):
        artifact_for(source, pin(), Origins())
