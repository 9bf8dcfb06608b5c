"""Media URLs an engine would fetch from the node's network are refused unless
the model's catalog entry says ``remote_media: true``; ``data:`` URLs pass
(router/api/media.py)."""

from pathlib import Path
from typing import Any

from tests.gateway_util import auth, gateway, ready, spec

STRICT, OPEN = "strict", "open"
PNG = "data:image/png;base64,iVBORw0KGgo="


def ask(model: str, *parts: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "text", "text": "what is this?"}, *parts]
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


REMOTE: list[tuple[dict[str, Any], str]] = [
    (
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}},
        "image_url.url",
    ),
    ({"type": "image_url", "image_url": " HTTPS://internal.example/x.png"}, "image_url"),
    ({"type": "audio_url", "audio_url": {"url": "file:///etc/shadow"}}, "audio_url.url"),
    ({"type": "video_url", "video_url": {"url": "ftp://10.0.0.1/v.mp4"}}, "video_url.url"),
    ({"type": "file", "file": {"file_url": "http://10.0.0.2/f.pdf"}}, "file.file_url"),
    ({"type": "x", "x": {"sources": [{"url": "http://10.0.0.3/"}]}}, "x.sources[0].url"),
]


async def test_remote_media_urls_are_refused_by_default(tmp_path: Path) -> None:
    models = [spec(STRICT), spec(OPEN).model_copy(update={"remote_media": True})]
    replicas = [ready("r1", STRICT, "http://e1:1"), ready("r2", OPEN, "http://e2:1")]
    async with gateway(tmp_path / "s.db", replicas, models) as gw:
        _, key = gw.key()
        for part, field in REMOTE:
            r = await gw.http.post(
                "/v1/chat/completions", json=ask(STRICT, part), headers=auth(key)
            )
            assert r.status_code == 400, (part, r.text)
            error = r.json()["error"]
            assert error["code"] == "remote_media_refused"
            assert error["param"] == f"messages[0].content[1].{field}"
        assert gw.engine.seen == []  # nothing reached the engine

        # Inline media passes, as does text alone.
        inline = [
            {"type": "image_url", "image_url": {"url": PNG}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        ]
        r = await gw.http.post("/v1/chat/completions", json=ask(STRICT, *inline), headers=auth(key))
        assert r.status_code == 200, r.text
        # A model whose entry allows remote media gets them forwarded.
        for part, _ in REMOTE:
            r = await gw.http.post("/v1/chat/completions", json=ask(OPEN, part), headers=auth(key))
            assert r.status_code == 200, r.text
        assert len(gw.engine.seen) == 1 + len(REMOTE)


def test_the_setting_does_not_restart_engines() -> None:
    # A router-side policy: changing it must not make running engines look stale.
    assert spec(STRICT).digest() == spec(STRICT).model_copy(update={"remote_media": True}).digest()


async def test_every_inference_body_is_checked_extra_fields_included(tmp_path: Path) -> None:
    # Engines take chat-shaped messages on other endpoints (vLLM's multimodal
    # embeddings) and every extra field reaches them unchanged.
    models = [spec(STRICT)]
    async with gateway(tmp_path / "s.db", [ready("r1", STRICT, "http://e1:1")], models) as gw:
        _, key = gw.key()
        image = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}
        bodies: list[tuple[str, dict[str, Any], str]] = [
            (
                "/v1/embeddings",
                {"model": STRICT, "input": "x", **ask(STRICT, image)},
                "messages[0].content[1].image_url.url",
            ),
            (
                "/v1/completions",
                {"model": STRICT, "prompt": "x", "max_tokens": 2, "media": {"url": "http://a/"}},
                "media.url",
            ),
            (
                "/v1/chat/completions",
                {**ask(STRICT), "extra": [{"video_url": "http://10.0.0.9/v"}]},
                "extra[0].video_url",
            ),
        ]
        for path, body, field in bodies:
            r = await gw.http.post(path, json=body, headers=auth(key))
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["code"] == "remote_media_refused"
            assert r.json()["error"]["param"] == field
        assert gw.engine.seen == []
        r = await gw.http.post(
            "/v1/embeddings", json={"model": STRICT, "input": "x", "image": PNG}, headers=auth(key)
        )
        assert r.status_code == 200, r.text
