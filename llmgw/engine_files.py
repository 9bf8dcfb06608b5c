"""Which files of a remote checkpoint an entry takes, and whether the engine can load them.

One rule for every remote source (``hf://``, ``s3://``): the entry's
``include`` / ``exclude`` glob patterns over the paths (``DEFAULT_INCLUDE``
when it names no include), then what the engine loads: vLLM and SGLang a
checkpoint with ``config.json`` and ``.safetensors`` weights. llama.cpp
serves one ``.gguf`` file, which the source names itself.
"""

from collections.abc import Iterable
from fnmatch import fnmatch

from llmgw.types.model import EngineKind

# What vLLM and SGLang read of a checkpoint when an entry names no include.
DEFAULT_INCLUDE = (
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
    "*.jinja",
)


def _pattern(pattern: str) -> str:
    # As huggingface_hub's filter_repo_objects reads them: "dir/" is all under it.
    return pattern + "*" if pattern.endswith("/") else pattern


def select(paths: Iterable[str], include: list[str] | None, exclude: list[str]) -> list[str]:
    """``paths`` that match an include pattern (``DEFAULT_INCLUDE`` for None) and no
    exclude pattern, in their order."""
    allow = [_pattern(p) for p in (DEFAULT_INCLUDE if include is None else include)]
    ignore = [_pattern(p) for p in exclude]
    return [
        path
        for path in paths
        if any(fnmatch(path, p) for p in allow) and not any(fnmatch(path, p) for p in ignore)
    ]


def checkpoint_problem(paths: Iterable[str], engine: EngineKind, where: str) -> str:
    """Why ``engine`` could not load a checkpoint of ``paths`` ("": it could);
    ``where`` names the source in the message."""
    names = set(paths)
    if "config.json" not in names:
        return f"{engine.value} needs config.json: none in {where} (after include/exclude)"
    if not any(n.endswith(".safetensors") for n in names):
        return f"{engine.value} needs .safetensors weights: none in {where} (after include/exclude)"
    return ""
