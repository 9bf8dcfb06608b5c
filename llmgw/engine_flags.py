"""Engine flags a catalog's ``engine_args`` must not carry: the ones llmgw sets itself.

``engine_args`` go on the command line after llmgw's own flags, and engines
take the last value given. Unchecked, one entry would get around every check
llmgw makes: ``--model /anywhere`` or a download (``-hf``, ``--model-url``)
around the weights roots (``LLMGW_WEIGHTS_ROOTS``), ``--lora PATH`` around the
adapter checks, ``--host 0.0.0.0`` around the agent's pass-through and its
engine key, ``--api-key`` around the key llmgw sets. So every flag that sets
the model, the listening address, the key, adapters, a download, or a file
or program outside the weights roots is refused, per engine, by name. There
is no escape hatch: each of these is something llmgw already sets from the
catalog's own (checked) fields.

Checked where a catalog entry is written (``catalog_problems``: the catalog
file, the admin API), by the control plane before a launch, and by the agent
(``plan_shard``) whoever asked for it.

How each engine reads its command line matters as much as the names:

* llama.cpp (``common/arg.cpp``) has short aliases (``-m``, ``-hf``, ``-mu``...)
  and takes ``--flag value``; ``--flag=value`` is refused too.
* vLLM (``FlexibleArgumentParser``, argparse) and SGLang (argparse) accept
  any unambiguous abbreviation (``--ho`` is ``--host``), ``--flag=value``,
  and vLLM also ``_`` for ``-`` and ``--flag.key value`` (JSON fields). vLLM's
  ``serve`` takes the model as a positional argument, and reads every option
  from a YAML file with ``--config``.

Flag lists from: llama.cpp ``tools/server/README.md`` (master, server-specific
and common params); vLLM ``vllm/utils/argparse_utils.py`` and the
``vllm serve`` options; SGLang ``python/sglang/srt/server_args.py``.
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.types import EngineKind

MODEL = "sets the model, which llmgw takes from the entry's source"
DOWNLOAD = "downloads (weights are read only from the weights roots)"
LISTEN = "sets where the engine listens, which the agent's pass-through decides"
KEY = "sets the engine key, which llmgw sets (and keeps off the command line)"
ADAPTERS = "loads adapters, which llmgw takes from the entry's adapters"
FILES = "reads or writes files outside the weights roots"
PROGRAMS = "runs programs or tools from the engine"
PEERS = "sets the multi-node peers, which llmgw wires"
SENDS = "connects to an address of its own choosing (data or traces leave the node)"


def _table(groups: Iterable[tuple[str, Iterable[str]]]) -> dict[str, str]:
    return {flag: why for why, flags in groups for flag in flags}


LLAMA_CPP = _table(
    [
        (
            MODEL,
            [
                "-m", "--model", "-a", "--alias", "--models-dir", "--models-preset",
                "-md", "--model-draft", "--spec-draft-model", "-mm", "--mmproj",
                "-mv", "--model-vocoder",
            ],
        ),
        (
            DOWNLOAD,
            [
                "-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file",
                "-hft", "--hf-token", "-hfv", "-hfrv", "--hf-repo-v", "-hffv", "--hf-file-v",
                "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", "-dr", "--docker-repo",
                "-mmu", "--mmproj-url",
            ],
        ),
        (LISTEN, ["--host", "--port", "--reuse-port", "--path", "--ssl-key-file",
                  "--ssl-cert-file"]),
        (KEY, ["--api-key", "--api-key-file"]),
        (ADAPTERS, ["--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled"]),
        (PEERS, ["--rpc"]),
        (
            FILES,
            [
                "--media-path", "--slot-save-path", "--log-file", "--log-prompts-dir",
                "-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic",
                "--chat-template-file", "--grammar-file", "-jf", "--json-schema-file",
                "--ui-config-file", "--webui-config-file", "--mcp-servers-config",
            ],
        ),
        (
            PROGRAMS,
            [
                "--tools", "--tools-runtime", "-ag", "--agent", "--mcp-servers-json",
                "--ui-mcp-proxy", "--webui-mcp-proxy", "--video-ffmpeg-dir",
            ],
        ),
    ]
)  # fmt: skip

VLLM = _table(
    [
        (
            MODEL,
            [
                "--model", "--served-model-name", "--tokenizer", "--hf-config-path",
                "--speculative-config", "--model-loader-extra-config", "--config",
            ],
        ),
        (DOWNLOAD, ["--download-dir", "--hf-token"]),
        (LISTEN, ["--host", "--port", "--uds", "--ssl-keyfile", "--ssl-certfile",
                  "--ssl-ca-certs"]),
        (KEY, ["--api-key"]),
        (ADAPTERS, ["--lora-modules", "--default-mm-loras"]),
        (FILES, ["--allowed-local-media-path", "--generation-config", "--chat-template"]),
        (
            PROGRAMS,
            [
                "--tool-parser-plugin", "--middleware", "--reasoning-parser-plugin",
                "--logits-processors", "--worker-extension-cls",
            ],
        ),
        (PEERS, ["--master-addr", "--data-parallel-address"]),
        (SENDS, ["--kv-transfer-config", "--kv-events-config", "--otlp-traces-endpoint"]),
    ]
)  # fmt: skip

SGLANG = _table(
    [
        (
            MODEL,
            [
                "--model-path", "--model", "--served-model-name", "--tokenizer-path",
                "--speculative-draft-model-path", "--speculative-draft-model",
                "--model-loader-extra-config", "--modelopt-checkpoint-restore-path", "--config",
            ],
        ),
        (DOWNLOAD, ["--download-dir", "--remote-instance-weight-loader-seed-instance-ip"]),
        (LISTEN, ["--host", "--port", "--ssl-keyfile", "--ssl-certfile"]),
        (KEY, ["--api-key", "--admin-api-key"]),
        (ADAPTERS, ["--lora-paths"]),
        (FILES, ["--allowed-local-media-path", "--chat-template"]),
        (PROGRAMS, ["--tool-server", "--custom-weight-loader"]),
        (PEERS, ["--dist-init-addr", "--nccl-init-addr"]),
    ]
)  # fmt: skip


@dataclass(frozen=True)
class FlagRules:
    """One engine's owned flags and how its parser reads a command line."""

    owned: Mapping[str, str]
    abbreviations: bool = False  # argparse: any unambiguous prefix of a long option
    underscores: bool = False  # vLLM: --api_key is --api-key
    positional_model: bool = False  # vLLM serve: a bare argument is the model
    # With positional_model: the flags known to take the next word as their
    # value. A bare word after any other flag (``--enforce-eager /anywhere``:
    # a switch, so the word is a positional) is refused; its value can always
    # be given as ``--flag=value``.
    value_flags: frozenset[str] = frozenset()


# vLLM options that take a value and that catalogs commonly set (``vllm serve
# --help``); a dotted JSON field (``--hf-overrides.key value``) takes one too.
VLLM_VALUE_FLAGS = frozenset(
    [
        "--dtype", "--max-model-len", "--kv-cache-memory-bytes", "--max-num-seqs",
        "--max-num-batched-tokens", "--seed", "--tokenizer-mode", "--gpu-memory-utilization",
        "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
        "--data-parallel-size", "-dp", "--quantization", "-q", "--block-size", "--swap-space",
        "--cpu-offload-gb", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
        "--revision", "--tokenizer-revision", "--code-revision", "--load-format",
        "--kv-cache-dtype", "--distributed-executor-backend", "--limit-mm-per-prompt",
        "--compilation-config", "-O", "--hf-overrides", "--override-generation-config",
        "--max-logprobs", "--tool-call-parser", "--reasoning-parser", "--uvicorn-log-level",
        "--scheduling-policy", "--max-seq-len-to-capture", "--num-scheduler-steps",
        "--rope-scaling", "--rope-theta", "--structured-outputs-config",
        "--guided-decoding-backend", "--response-role", "--max-parallel-loading-workers",
        "--long-prefill-token-threshold", "--max-num-partial-prefills",
        "--mm-processor-kwargs", "--max-long-partial-prefills", "--num-gpu-blocks-override",
    ]
)  # fmt: skip

# llama.cpp's slot flags. With ``routing.slots`` on they are llmgw's: the agent
# starts the server with the two below (worker_agent/engines/llamacpp.py) and
# the catalog refuses any of the set beside it (llmgw/catalog.py).
LLAMA_PARALLEL = "--parallel"
LLAMA_NO_CACHE_IDLE_SLOTS = "--no-cache-idle-slots"
# Where the server saves and restores slots (the router primes a slot from
# another: router/forwarding/slot_priming.py); a FILES flag, refused above.
LLAMA_SLOT_SAVE_PATH = "--slot-save-path"
LLAMA_SLOT_FLAGS = frozenset(
    {"-np", LLAMA_PARALLEL, "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"}
    | {"--cache-idle-slots", LLAMA_NO_CACHE_IDLE_SLOTS}
)

RULES: Mapping[EngineKind, FlagRules] = {
    EngineKind.LLAMA_CPP: FlagRules(LLAMA_CPP),
    EngineKind.VLLM: FlagRules(
        VLLM,
        abbreviations=True,
        underscores=True,
        positional_model=True,
        value_flags=VLLM_VALUE_FLAGS,
    ),
    EngineKind.SGLANG: FlagRules(SGLANG, abbreviations=True),
}

# A value that starts with "-" yet is no flag: a negative number.
_NUMBER = re.compile(r"-\d")
# argparse needs this much of a long option to be a prefix worth matching.
_MIN_PREFIX = 4


def owned_flag_problems(
    engine: EngineKind, args: Sequence[str], field: str = "engine_args"
) -> list[str]:
    """Why ``args`` may not be passed to ``engine``: one line per refused flag, naming it."""
    rules = RULES[engine]
    problems: list[str] = []
    takes_value = False  # the previous token was a flag that takes this one as its value
    for arg in args:
        if not arg.startswith("-") or _NUMBER.match(arg) or arg == "-":
            if rules.positional_model and not takes_value:
                problems.append(
                    f"{field}: {arg!r} is a positional argument, which vLLM serve takes as the "
                    f"model ({MODEL}), or the value of a flag not known to take one: remove it, "
                    "or give it as --flag=value"
                )
            takes_value = False
            continue
        name, eq, _ = arg.partition("=")
        found = _owned(name, rules)
        # An owned flag is refused already: its value needs no second line.
        takes_value = not eq and (found is not None or _takes_value(name, rules))
        if found is None:
            continue
        flag, why = found
        shown = name if name == flag else f"{name} (read as {flag})"
        problems.append(f"{field}: {shown} {why}: remove it from {field}")
    return problems


def _takes_value(name: str, rules: FlagRules) -> bool:
    """Whether flag ``name`` takes the next word as its value, as far as llmgw knows.

    Only judged where a bare word could be the model (vLLM); elsewhere every
    flag may take one (llama.cpp and SGLang read no positional argument).
    """
    if not rules.positional_model:
        return True
    if rules.underscores and name.startswith("--"):
        if "." in name:
            return True  # --json-arg.key value
        name = name.replace("_", "-")
    return name in rules.value_flags


def _owned(name: str, rules: FlagRules) -> tuple[str, str] | None:
    """The owned flag ``name`` is read as, and why it is owned; None if it is not."""
    if rules.underscores and name.startswith("--"):
        # vLLM: the name is everything before the first "." (--json-arg.key),
        # with "_" read as "-".
        name = name.partition(".")[0].replace("_", "-")
    if name in rules.owned:
        return name, rules.owned[name]
    if rules.abbreviations and name.startswith("--") and len(name) >= _MIN_PREFIX:
        # An abbreviation: refused when it could stand for an owned flag,
        # ambiguous or not (argparse refuses the ambiguous ones anyway).
        for flag in sorted(rules.owned):
            if flag.startswith(name):
                return flag, rules.owned[flag]
    return None
