"""Media URLs in inference bodies: refused unless the model's catalog entry allows them.

An engine given an ``image_url`` (or an audio, video or file URL) fetches it
itself, from the node's network: a client could make it reach addresses only
the cluster reaches (metadata services, other engines, internal APIs). So by
default only ``data:`` URLs, which carry the media inline, pass; a model's
``remote_media: true`` lets any URL through to engines that fetch them.

Every key named ``url`` or ending in ``_url`` anywhere in the body counts, at
any depth (``{"type": "image_url", "image_url": {"url": ...}}``, vLLM's
``audio_url`` and ``video_url``, a ``file``'s URL), in every inference body
(chat, completions, embeddings), its extra fields included: every field
reaches the engine unchanged, engines keep adding media types and accept
chat-shaped ``messages`` on other endpoints (vLLM's multimodal embeddings),
and a field the router does not know must not become a way past.
"""

from typing import Any

from pydantic import BaseModel

from router.api.deps import Deps
from router.common.errors import ErrorKind


def check_media(deps: Deps, body: BaseModel) -> None:
    """Raise 400 for an inference request carrying a remote media URL, unless
    its model's catalog entry (an adapter's: its base model's) allows them."""
    model = str(getattr(body, "model", ""))
    target = deps.adapters.base_of(model)
    spec = target[0] if target else deps.table.specs.get(model)
    if spec is not None and spec.remote_media:
        return
    if (where := remote_media(body)) is not None:
        raise ErrorKind.REMOTE_MEDIA_REFUSED.error(model=model, where=where, param=where)


def remote_media(body: BaseModel) -> str | None:
    """Where the first media URL that is not ``data:`` sits in the whole body,
    extra fields included (``messages[0].content[1].image_url.url``), or None."""
    return _url_in(body.model_dump(exclude_unset=True), "")


def _url_in(value: Any, where: str) -> str | None:
    if isinstance(value, dict):
        for key, inner in value.items():
            here = f"{where}.{key}" if where else str(key)
            if isinstance(inner, str):
                if _is_url_key(key) and inner.lstrip()[:5].lower() != "data:":
                    return here
            elif (found := _url_in(inner, here)) is not None:
                return found
    elif isinstance(value, list):
        for k, inner in enumerate(value):
            if (found := _url_in(inner, f"{where}[{k}]")) is not None:
                return found
    return None


def _is_url_key(key: object) -> bool:
    return isinstance(key, str) and (key == "url" or key.endswith("_url"))
