"""A Bloom filter of paths: what an agent has under its weights roots, in a few KiB.

An agent's inventory travels in every registration and lives in the fleet
workflow's state for every node, so a listing of its weights roots would grow
the fleet's history and snapshot with each file. A Bloom filter answers the
one question ``llmgw model apply`` asks, "is this path there?", with "no"
for certain and "maybe" otherwise (about 1% wrongly "maybe" when full), in a
size fixed by how many paths it was made for. Hashes are blake2b, so any
process and version reads a filter the same way.
"""

import base64
import hashlib
from typing import Self

# Marks a directory whose contents were not walked: "opaque:" + its path.
OPAQUE = "opaque:"
BITS_PER_PATH = 10  # with HASHES, about a 1% false "maybe" at capacity
HASHES = 7


class PathFilter:
    """A fixed-size Bloom filter of strings."""

    def __init__(self, bits: int, data: bytes | None = None) -> None:
        if bits <= 0:
            raise ValueError("a filter needs at least one bit")
        self.bits = bits
        self._data = bytearray(data) if data is not None else bytearray((bits + 7) // 8)
        if len(self._data) != (bits + 7) // 8:
            raise ValueError(f"{len(self._data)} bytes do not hold {bits} bits")

    @classmethod
    def for_paths(cls, capacity: int) -> Self:
        """An empty filter sized for ``capacity`` paths."""
        return cls(max(64, capacity * BITS_PER_PATH))

    @classmethod
    def decode(cls, text: str, bits: int) -> Self:
        """The filter ``encode`` gave (``bits`` as it was made)."""
        return cls(bits, base64.b64decode(text))

    def encode(self) -> str:
        """The filter as text, for a pydantic model."""
        return base64.b64encode(bytes(self._data)).decode()

    def add(self, key: str) -> None:
        """Put ``key`` in."""
        for i in self._indices(key):
            self._data[i // 8] |= 1 << (i % 8)

    def __contains__(self, key: object) -> bool:
        """False: ``key`` was never added. True: it probably was."""
        if not isinstance(key, str):
            return False
        return all(self._data[i // 8] >> (i % 8) & 1 for i in self._indices(key))

    def _indices(self, key: str) -> list[int]:
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "big")
        h2 = int.from_bytes(digest[8:], "big") | 1
        return [(h1 + i * h2) % self.bits for i in range(HASHES)]
