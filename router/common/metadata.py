"""OpenAI's ``metadata``: at most 16 pairs, keys up to 64 characters, values up
to 512. One validator for every request that takes it (``POST /v1/batches``,
``POST /v1/responses``), so that both refuse the same maps with the same words.
"""

from typing import Annotated

from pydantic import AfterValidator

METADATA_PAIRS = 16
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512


def bounded_metadata(value: dict[str, str]) -> dict[str, str]:
    """``value`` if OpenAI's bounds hold; ValueError naming the first that does not."""
    if len(value) > METADATA_PAIRS:
        raise ValueError(f"at most {METADATA_PAIRS} pairs")
    for key, item in value.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"key {key[:20]!r}... is longer than {METADATA_KEY_CHARS}")
        if len(item) > METADATA_VALUE_CHARS:
            raise ValueError(f"the value of {key!r} is longer than {METADATA_VALUE_CHARS}")
    return value


# A request model's field: ``metadata: Metadata | None = None``.
Metadata = Annotated[dict[str, str], AfterValidator(bounded_metadata)]
