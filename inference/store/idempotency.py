"""`idempotency_keys`: a key names one request body (Stripe's rule). Claims are atomic on both
backends, so two processes racing for one key agree on who holds it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.store.engine import _aware, utc_now
from inference.store.merge import _insert_for
from inference.store.schema import idempotency_keys


@dataclass(frozen=True)
class KeyClaim:
    """The store's word on an idempotency key: who holds it, for which body, and its answer if done."""

    request_hash: str
    request_id: str
    response: str | None
    created_at: datetime

    def owned_by(self, request_id: str) -> bool:
        return self.request_id == request_id


def claim_idempotency_key(conn: Connection, *, key: str, request_hash: str, request_id: str) -> KeyClaim:
    """Claim `key` for this request body unless some request (any process) already did; returns
    the claim that stands. Atomic on both backends: INSERT ... ON CONFLICT DO NOTHING, then read."""
    insert = _insert_for(conn, idempotency_keys)
    conn.execute(
        insert.values(
            idempotency_key=key, request_hash=request_hash, request_id=request_id, created_at=utc_now()
        ).on_conflict_do_nothing(index_elements=["idempotency_key"])
    )
    return _standing_claim(conn, key)


def store_idempotency_answer(
    conn: Connection, *, key: str, request_hash: str, request_id: str, response: str
) -> KeyClaim | None:
    """Store `response` as `key`'s answer: it completes this request's claim, or claims the key with
    it when that claim never reached the store. None when the key now holds it; else the claim that
    stands, another request's (its answer, stored first, is the one the key replays)."""
    if complete_idempotency_key(conn, key=key, request_id=request_id, response=response):
        return None
    now = utc_now()
    claimed = conn.execute(
        _insert_for(conn, idempotency_keys)
        .values(
            idempotency_key=key,
            request_hash=request_hash,
            request_id=request_id,
            response=response,
            created_at=now,
            completed_at=now,
        )
        .on_conflict_do_nothing(index_elements=["idempotency_key"])
    )
    return None if claimed.rowcount else _standing_claim(conn, key)


def _standing_claim(conn: Connection, key: str) -> KeyClaim:
    k = idempotency_keys.c
    row = conn.execute(
        sa.select(k.request_hash, k.request_id, k.response, k.created_at).where(k.idempotency_key == key)
    ).one()
    return KeyClaim(row.request_hash, row.request_id, row.response, _aware(row.created_at))


def complete_idempotency_key(conn: Connection, *, key: str, request_id: str, response: str) -> bool:
    """Whether this request's unanswered claim took `response`."""
    k = idempotency_keys.c
    completed = conn.execute(
        sa.update(idempotency_keys)
        .where(k.idempotency_key == key, k.request_id == request_id, k.response.is_(None))
        .values(response=response, completed_at=utc_now())
    )
    return bool(completed.rowcount)


def release_idempotency_key(conn: Connection, *, key: str, request_id: str) -> None:
    """Give up an unanswered claim (the request was shed or expired), so a retry may score."""
    k = idempotency_keys.c
    conn.execute(
        sa.delete(idempotency_keys).where(k.idempotency_key == key, k.request_id == request_id, k.response.is_(None))
    )


def take_over_idempotency_key(conn: Connection, *, key: str, request_id: str, claimed_before: datetime) -> bool:
    """Move an unanswered claim older than `claimed_before` (its process died) to this request."""
    k = idempotency_keys.c
    stmt = (
        sa.update(idempotency_keys)
        .where(k.idempotency_key == key, k.response.is_(None), k.created_at < claimed_before)
        .values(request_id=request_id, created_at=utc_now())
    )
    return bool(conn.execute(stmt).rowcount)
