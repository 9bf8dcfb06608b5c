"""OpenAI's metadata bounds (router/common/metadata.py), held the same by every
request that takes metadata: a batch and a response refuse the same maps with
the same words, and take the largest map the bounds allow."""

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from router.api.batches import BatchCreate
from router.common.metadata import METADATA_KEY_CHARS, METADATA_PAIRS, METADATA_VALUE_CHARS
from router.responses.request import ResponsesRequest

BASES: dict[type[BaseModel], dict[str, Any]] = {
    BatchCreate: {
        "input_file_id": "file-1",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    },
    ResponsesRequest: {"model": "m", "input": "hi"},
}


def _refusal(model: type[BaseModel], metadata: dict[str, str]) -> tuple[tuple[Any, ...], str]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate({**BASES[model], "metadata": metadata})
    error = caught.value.errors()[0]
    return error["loc"], error["msg"]


@pytest.mark.parametrize(
    ("metadata", "said"),
    [
        ({f"k{i}": "v" for i in range(METADATA_PAIRS + 1)}, "at most 16 pairs"),
        ({"k" * (METADATA_KEY_CHARS + 1): "v"}, "is longer than 64"),
        ({"k": "v" * (METADATA_VALUE_CHARS + 1)}, "the value of 'k' is longer than 512"),
    ],
    ids=["pairs", "key", "value"],
)
def test_batches_and_responses_refuse_the_same_metadata_alike(
    metadata: dict[str, str], said: str
) -> None:
    batch, response = (_refusal(model, metadata) for model in BASES)
    assert batch == response
    assert batch[0] == ("metadata",) and said in batch[1]


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
def test_the_largest_metadata_within_the_bounds_is_taken(model: type[BaseModel]) -> None:
    largest = {
        f"{i:0{METADATA_KEY_CHARS}d}": "v" * METADATA_VALUE_CHARS for i in range(METADATA_PAIRS)
    }
    parsed = model.model_validate({**BASES[model], "metadata": largest})
    assert parsed.model_dump()["metadata"] == largest
