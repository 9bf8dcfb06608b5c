"""Client API keys with their policy: model allow-list, expiry, admin, quotas.

A key is shown once, at creation; the store keeps its SHA-256 only (see
``llmgw.api_keys``). Lookups go by hash and the found hash is compared again with
``hmac.compare_digest``, so no comparison against a presented key leaks
timing. Admin keys open the admin API and nothing else.
"""

import hmac
import json
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlmodel import select

from llmgw.api_keys import hash_api_key, new_api_key
from llmgw.store import ApiKey, Store
from llmgw.types import Priority
from router.billing.key_policy import INT32_MAX, MAX_WEIGHT, IsoDateTime, KeyPolicy
from router.billing.quotas import Quotas

# A key's name: printable (no NUL or other control character, which would
# corrupt a listing, a log line or a terminal), 1 to 200 characters.
NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"
KeyName = Annotated[str, Field(min_length=1, max_length=200, pattern=NAME_PATTERN)]


class KeyInfo(BaseModel):
    """A key as listed: never its secret."""

    id: int
    name: str
    prefix: str
    created_at: datetime
    revoked: bool
    policy: KeyPolicy

    def expired(self, now: datetime) -> bool:
        """Whether the key is past its expiry at ``now``."""
        return self.policy.expires_at is not None and now >= self.policy.expires_at


def _utc(when: datetime | None) -> datetime | None:
    # SQLite hands datetimes back without a zone; they were stored as UTC.
    if when is None or when.tzinfo is not None:
        return when
    return when.replace(tzinfo=UTC)


def _priority(text: str) -> Priority:
    try:
        return Priority(text)
    except ValueError:
        return Priority.NORMAL


def _info(row: ApiKey) -> KeyInfo:
    assert row.id is not None
    created = _utc(row.created_at)
    assert created is not None
    return KeyInfo(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        created_at=created,
        revoked=row.revoked,
        policy=KeyPolicy(
            models=json.loads(row.models_json) if row.models_json else [],
            expires_at=_utc(row.expires_at),
            admin=row.admin,
            rpm=row.rpm,
            tpm=row.tpm,
            token_budget=row.token_budget,
            budget_period="month" if row.budget_period == "month" else "day",
            weight=row.weight if row.weight > 0 else 1.0,
            priority=_priority(row.priority),
        ),
    )


def create_key(store: Store, name: str, policy: KeyPolicy) -> tuple[KeyInfo, str]:
    """Create a key; returns its record and the key in clear (shown this once)."""
    key = new_api_key()
    expires = policy.expires_at.astimezone(UTC) if policy.expires_at else None
    row = ApiKey(
        name=name,
        key_hash=hash_api_key(key),
        prefix=key[:14],
        created_at=datetime.now(UTC),
        models_json=json.dumps(policy.models) if policy.models else "",
        expires_at=expires,
        admin=policy.admin,
        rpm=policy.rpm,
        tpm=policy.tpm,
        token_budget=policy.token_budget,
        budget_period=policy.budget_period,
        weight=policy.weight,
        priority=policy.priority.value,
    )
    with store.session() as session:
        session.add(row)
        session.commit()
        session.refresh(row)
        info = _info(row)
    if policy.has_quota():
        Quotas(store).ensure_row(info.id)
    return info, key


def list_keys(store: Store) -> list[KeyInfo]:
    """Every key, revoked ones included, oldest first."""
    with store.session() as session:
        return [_info(r) for r in session.exec(select(ApiKey).order_by(ApiKey.id)).all()]  # type: ignore[arg-type]


def get_key(store: Store, key_id: int) -> KeyInfo | None:
    """One key by id."""
    with store.session() as session:
        row = session.get(ApiKey, key_id)
        return _info(row) if row else None


def revoke_key(store: Store, key_id: int) -> KeyInfo | None:
    """Revoke a key (kept for its usage history); None when there is no such key."""
    with store.session() as session:
        row = session.get(ApiKey, key_id)
        if row is None:
            return None
        row.revoked = True
        session.add(row)
        session.commit()
        session.refresh(row)
        return _info(row)


class KeyUpdate(BaseModel):
    """Changes to a key (PATCH): only the fields given change; ``expires_at: null``
    removes the expiry. Whether a key is an admin key is fixed at creation.
    Numbers are strict: a string is refused, never read as one."""

    model_config = ConfigDict(extra="forbid")

    name: KeyName | None = None
    models: list[str] | None = None
    expires_at: IsoDateTime | None = None
    rpm: int | None = Field(default=None, ge=0, le=INT32_MAX, strict=True)
    tpm: int | None = Field(default=None, ge=0, le=INT32_MAX, strict=True)
    token_budget: int | None = Field(default=None, ge=0, le=INT32_MAX, strict=True)
    budget_period: Literal["day", "month"] | None = None
    weight: float | None = Field(default=None, gt=0, le=MAX_WEIGHT, strict=True)
    priority: Priority | None = None


def update_key(store: Store, key_id: int, update: KeyUpdate) -> KeyInfo | None:
    """Change a key's name or policy in place (its secret and usage stay);
    None when there is no such key. A revoked key is not changed: its record
    as it is (``revoked``: the caller refuses the change), so its policy
    stays what it had when it was revoked."""
    given = update.model_fields_set
    with store.session() as session:
        row = session.get(ApiKey, key_id)
        if row is None:
            return None
        if row.revoked:
            return _info(row)
        if update.name is not None:
            row.name = update.name
        if update.models is not None:
            row.models_json = json.dumps(update.models) if update.models else ""
        if "expires_at" in given:
            row.expires_at = update.expires_at.astimezone(UTC) if update.expires_at else None
        for field in ("rpm", "tpm", "token_budget", "budget_period", "weight"):
            value = getattr(update, field)
            if value is not None:
                setattr(row, field, value)
        if update.priority is not None:
            row.priority = update.priority.value
        session.add(row)
        session.commit()
        session.refresh(row)
        info = _info(row)
    if info.policy.has_quota():
        Quotas(store).ensure_row(info.id)
    return info


def lookup(store: Store, key: str) -> KeyInfo | None:
    """The live (not revoked) key matching a presented key, or None.

    Expiry is the caller's to check, against its own clock.
    """
    digest = hash_api_key(key)
    with store.session() as session:
        row = session.exec(select(ApiKey).where(ApiKey.key_hash == digest)).first()
        if row is None or row.revoked or not hmac.compare_digest(row.key_hash, digest):
            return None
        return _info(row)
