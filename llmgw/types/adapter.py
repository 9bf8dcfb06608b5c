"""LoRA adapters: the catalog entry and the on-demand load job."""

from pydantic import BaseModel, ConfigDict, Field


class AdapterSpec(BaseModel):
    """An adapter registered for a base model (engines load only these)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, description="what clients send as the OpenAI model")
    source: str = Field(min_length=1, description="a path on the nodes (PEFT dir or GGUF)")
    rank: int = Field(default=8, ge=1)


class AdapterLoadInput(BaseModel):
    """Input of the AdapterLoad workflow (id ``adapter/<replica>/<adapter>``)."""

    replica_id: str
    node_id: str
    adapter: AdapterSpec
    evict: str | None = Field(default=None, description="an idle adapter to unload first (LRU)")
    max_loaded: int = Field(
        default=0, ge=0, description="the replica's cap (0: unchecked); a full engine makes room"
    )


class AdapterLoadResult(BaseModel):
    """What the load did."""

    replica_id: str
    adapter: str
    loaded: bool = Field(description="false when the engine already had it")
    evicted: str | None = None
    detail: str = ""


class AdapterCall(BaseModel):
    """Input of the node activities ``load_adapter`` / ``unload_adapter``."""

    replica_id: str
    name: str
    path: str = ""
    max_loaded: int = Field(default=0, description="load: the replica's cap (0: unchecked)")


class AdapterCallResult(BaseModel):
    """The engine's answer: done, or already so (loaded twice, unknown on unload)."""

    changed: bool
    detail: str = ""
    unloaded: list[str] = Field(
        default_factory=list, description="load: idle adapters unloaded because the engine was full"
    )


class AdaptersChanged(BaseModel):
    """Signal ``adapters_changed`` to a replica: recorded in its history and memo."""

    loaded: list[str] = Field(default_factory=list)
    unloaded: list[str] = Field(default_factory=list)
    reason: str = ""
