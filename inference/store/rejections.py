"""`rejected_records`: quarantine of what either path refused (a record, or a result row the
store refused), and its resolution (superseded by a correction, or fixed by an operator)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import RECEIVED_PREFIX, hash_inputs
from inference.spec import LoadedSpec
from inference.store.engine import _chunks, utc_now
from inference.store.merge import _SQLITE_ROWS_PER_STATEMENT, _insert_for
from inference.store.record_table import record_table
from inference.store.schema import UNWRITABLE_RESULT, RejectStage, Resolution, ResultPath, rejected_records


# ------------------------------------------------------------------ quarantine
def _storable(value: Any) -> Any:
    """Text PostgreSQL can hold: NUL written as the four characters \\x00."""
    return value.replace("\x00", "\\x00") if isinstance(value, str) else value


def quarantine_unwritable_result(conn: Connection, row: dict[str, Any], error: str, *, path: ResultPath) -> None:
    """Keep a result row the store refused (a data error, not an outage) as a rejection, so it is
    seen and kept instead of blocking the rows behind it. Text is made storable first (PostgreSQL
    text cannot hold NUL), because the payload must land even when the original could not."""

    # json.dumps writes NUL as the six characters \u0000, which text columns hold.
    payload = json.dumps(row, sort_keys=True, default=str, allow_nan=True)
    record_id = _storable(row.get("record_id"))
    digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
    key = "|".join([path.value, RejectStage.WRITE.value, str(record_id), digest])
    now = utc_now()
    insert = _insert_for(conn, rejected_records)
    conn.execute(
        insert.values(
            rejection_key=hashlib.sha256(key.encode()).hexdigest()[:40],
            record_id=record_id,
            path=path.value,
            stage=RejectStage.WRITE.value,
            request_id=_storable(row.get("request_id")),
            reason=UNWRITABLE_RESULT,
            detail=_storable(error)[:500],
            payload=payload,
            input_hash=_storable(str(row.get("input_hash"))),
            first_seen=now,
            last_seen=now,
            seen_count=1,
            resolved=False,
        ).on_conflict_do_update(
            index_elements=["rejection_key"],
            set_={"last_seen": insert.excluded.last_seen, "seen_count": rejected_records.c.seen_count + 1},
        )
    )


def _as_received(
    columns: tuple[str, ...], rejected: pl.DataFrame, raw_rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each row's payload with every field as received where a source handed it beside the value
    read (`RECEIVED_PREFIX`: "12;50" rather than no number, " US$ " rather than "US$"), and the
    received texts the RAW values do not hold ("12;50" and "12;5O" both read as no number), which
    key the rejection too, so that a changed record is a new rejection."""
    payloads = [dict(raw) for raw in raw_rows]
    as_received = [""] * rejected.height
    for name in columns:
        if f"{RECEIVED_PREFIX}{name}" in rejected.columns:
            values = rejected[f"{RECEIVED_PREFIX}{name}"].to_list()
            for row, (payload, value) in enumerate(zip(payloads, values, strict=True)):
                if value is not None and value != payload[name]:
                    payload[name] = value
                    as_received[row] += f"|{name}={value}"
    return payloads, as_received


def quarantine(
    ls: LoadedSpec,
    conn: Connection,
    rejected: pl.DataFrame,
    *,
    path: ResultPath,
    stage: RejectStage,
    partition_key: str | None = None,
    run_id: str | None = None,
    request_id: str | None = None,
) -> int:
    """Record rejected rows (RAW columns + reject_reason [+ reject_detail] [+ received_<field>])
    with their reason.

    The same record rejected again for the same reason (a rerun) updates `last_seen` instead of
    adding a row, and reopens it if it was resolved: the record is refused again (an operator
    marked it fixed but the source still sends it, or an old bad version was re-sent after its
    correction), so it is open in quarantine and counted against its partition (the partition it
    was last refused in). A changed record is a new rejection.
    """
    if rejected.is_empty():
        return 0
    now = utc_now()
    rt = record_table(ls)
    hashes = hash_inputs(ls, rejected)
    details = rejected["reject_detail"].to_list() if "reject_detail" in rejected.columns else [None] * rejected.height
    records = []
    raw_rows = rejected.select(rt.raw_columns).to_dicts()
    payloads, as_received = _as_received(rt.raw_columns, rejected, raw_rows)
    for raw, payload, reason, detail, digest, received in zip(
        raw_rows, payloads, rejected["reject_reason"].to_list(), details, hashes.to_list(), as_received, strict=True
    ):
        key = "|".join([path.value, stage.value, str(raw[rt.id]), str(reason), digest]) + received
        records.append(
            {
                "rejection_key": hashlib.sha256(key.encode()).hexdigest()[:40],
                # A record refused for a NUL (`nul_character`) must still land: PostgreSQL text
                # cannot hold one. The payload's json.dumps writes it as \u0000 already.
                "record_id": _storable(raw[rt.id]),
                "path": path.value,
                "stage": stage.value,
                "partition_key": partition_key,
                "run_id": run_id,
                "request_id": request_id,
                "reason": reason,
                "detail": _storable(detail),
                "payload": json.dumps(payload, sort_keys=True, default=str, allow_nan=True),
                "input_hash": digest,
                "first_seen": now,
                "last_seen": now,
                "seen_count": 1,
                "resolved": False,
                "resolved_at": None,
            }
        )
    insert = _insert_for(conn, rejected_records)
    stmt = insert.on_conflict_do_update(
        index_elements=["rejection_key"],
        set_={
            "last_seen": insert.excluded.last_seen,
            "seen_count": rejected_records.c.seen_count + 1,
            "run_id": insert.excluded.run_id,
            "partition_key": insert.excluded.partition_key,
            "resolved": False,
            "resolved_at": None,
            "resolution": None,
        },
    )
    for chunk in _chunks(records, _SQLITE_ROWS_PER_STATEMENT):
        conn.execute(stmt, chunk)
    return len(records)


# ------------------------------------------------------------------ reads
def count_rejected(conn: Connection, *, partition_key: str, stage: RejectStage | None = None) -> int:
    stmt = (
        sa.select(sa.func.count())
        .select_from(rejected_records)
        .where(rejected_records.c.partition_key == partition_key)
    )
    if stage is not None:
        stmt = stmt.where(rejected_records.c.stage == stage.value)
    return int(conn.execute(stmt).scalar_one())


def rejection_rows(conn: Connection, record_id: str) -> list[dict[str, Any]]:
    """Every quarantine row of one record, oldest first (the id as `quarantine` stores it)."""
    r = rejected_records.c
    stmt = sa.select(rejected_records).where(r.record_id == _storable(record_id)).order_by(r.first_seen, r.rejection_id)
    return [dict(row) for row in conn.execute(stmt).mappings()]


# ------------------------------------------------------------------ resolution
def _open_score_rejection(partition_key: str) -> sa.ColumnElement[bool]:
    r = rejected_records.c
    return sa.and_(r.partition_key == partition_key, r.stage == RejectStage.SCORE.value, r.resolved.is_(False))


def resolve_unsent_ingest_rejections(conn: Connection, *, partition_key: str, before: datetime) -> int:
    """Mark a partition's open ingest rejections not seen since `before` (the start of this
    ingest) resolved: its source no longer sends them (a corrected file), so they no longer count
    against the day. One sent again is reopened by `quarantine`."""
    r = rejected_records.c
    stmt = (
        sa.update(rejected_records)
        .where(
            r.partition_key == partition_key,
            r.stage == RejectStage.INGEST.value,
            r.resolved.is_(False),
            r.last_seen < before,
        )
        .values(**_superseded())
    )
    return int(conn.execute(stmt).rowcount)


def _superseded() -> dict[str, Any]:
    return {"resolved": True, "resolved_at": utc_now(), "resolution": Resolution.SUPERSEDED.value}


def resolve_superseded_rejections(ls: LoadedSpec, conn: Connection, *, partition_key: str) -> int:
    """Mark a partition's scoring rejections resolved once their record has changed (a correction):
    the quarantined input no longer exists, so it no longer counts against the partition."""
    rt = record_table(ls)
    r, t = rejected_records.c, rt.c
    changed = sa.select(t[rt.id]).where(t[rt.id] == r.record_id, t.input_hash != r.input_hash)
    stmt = (
        sa.update(rejected_records)
        .where(_open_score_rejection(partition_key), changed.exists())
        .values(**_superseded())
    )
    return int(conn.execute(stmt).rowcount)


def open_score_rejections(conn: Connection, *, partition_key: str) -> set[str]:
    """Record ids of a partition's open scoring rejections."""
    r = rejected_records.c
    stmt = sa.select(r.record_id).where(_open_score_rejection(partition_key), r.record_id.is_not(None))
    return set(conn.execute(stmt).scalars())


def resolve_rescored_rejections(conn: Connection, *, partition_key: str, record_ids: Sequence[str]) -> int:
    """Mark a partition's open scoring rejections resolved for records a production run has just
    scored: a model that refused a record (a non-finite score) is replaced by one that scores it,
    or a correction is scored, and the record's answer is now its score. Left open, the record
    counted as scored AND rejected (scored + rejected > input) and kept the reject rate up. A
    record a re-sent day withdrew (`withdrawals`) has its rejections ended the same way."""
    r = rejected_records.c
    resolved = 0
    for chunk in _chunks(record_ids, 1000):
        stmt = (
            sa.update(rejected_records)
            .where(_open_score_rejection(partition_key), r.record_id.in_(chunk))
            .values(**_superseded())
        )
        resolved += int(conn.execute(stmt).rowcount)
    return resolved


def mark_rejections_fixed(conn: Connection, rejection_ids: Sequence[int]) -> int:
    """An operator's word that the source of these rejected records was fixed."""
    stmt = (
        sa.update(rejected_records)
        .where(rejected_records.c.rejection_id.in_(list(rejection_ids)), rejected_records.c.resolved.is_(False))
        .values(resolved=True, resolved_at=utc_now(), resolution=Resolution.OPERATOR.value)
    )
    return int(conn.execute(stmt).rowcount)
