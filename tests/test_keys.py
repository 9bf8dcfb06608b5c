"""Engine-key derivation and client key hashing."""

import pytest

from llmgw.keys import API_KEY_PREFIX, engine_key, hash_api_key, new_api_key


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

