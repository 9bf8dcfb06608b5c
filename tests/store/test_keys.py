"""Engine-key derivation, client key hashing, and the router's key checks."""

import asyncio
from pathlib import Path

import pytest
from sqlalchemy import event

from llmgw.api_keys import API_KEY_PREFIX, hash_api_key, new_api_key
from llmgw.engine_keys import engine_key
from llmgw.store import Store
from router.api.apikeys import create_key
from router.api.auth import KeyVerifier
from router.billing.key_policy import KeyPolicy
from router.common.errors import OpenAIError


def test_engine_key_is_a_function_of_secret_and_replica() -> None:
    assert engine_key("s1", "r1") == engine_key("s1", "r1")
    assert engine_key("s1", "r1") != engine_key("s1", "r2")
    assert engine_key("s1", "r1") != engine_key("s2", "r1")


def test_engine_key_matches_hmac_sha256() -> None:
    # Pinned: routers and agents of different versions must agree on keys.
    assert engine_key("secret", "replica") == (
        "llmgw-engine-d9ee59b3a5d24f38a1a2813634c419f1a9cdda9a7370b9eae79b224595b6622d"
    )


def test_empty_secret_is_refused() -> None:
    with pytest.raises(ValueError):
        engine_key("", "r1")


def test_api_keys_are_random_and_hashed() -> None:
    a, b = new_api_key(), new_api_key()
    assert a != b and a.startswith(API_KEY_PREFIX)
    assert hash_api_key(a) != a and len(hash_api_key(a)) == 64
    assert hash_api_key(a) == hash_api_key(a)
    assert hash_api_key(a) != hash_api_key(b)


async def test_concurrent_checks_of_an_uncached_key_share_one_store_lookup(
    tmp_path: Path,
) -> None:
    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    store.migrate()
    info, key = create_key(store, "busy", KeyPolicy())
    lookups: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "FROM apikey" in statement:
            lookups.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    verifier = KeyVerifier(store, ttl_s=60)
    callers = await asyncio.gather(*(verifier.verify(f"Bearer {key}") for _ in range(50)))
    assert {c.key_id for c in callers} == {info.id}
    assert len(lookups) == 1
    # Cached from then on; a bad key is looked up (once) and refused.
    await verifier.verify(f"Bearer {key}")
    with pytest.raises(OpenAIError):
        await asyncio.gather(*(verifier.verify("Bearer sk-nope") for _ in range(5)))
    assert len(lookups) == 2
    store.close()
