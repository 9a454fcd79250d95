"""Records a re-sent day no longer holds: a row missing from the corrected file, or one its ingest
now refuses. The day's source is what the day holds, so such a record leaves the record table
(no longer history, no longer scored) with its batch answers; its online answers stay, as what a
caller was told. `withdrawn_records` keeps where it stood, for the rescoring sensor (`watch`)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import date
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import EVENT_TS_DTYPE
from inference.spec import LoadedSpec
from inference.store.engine import utc_now
from inference.store.merge import _merge
from inference.store.record_table import record_table
from inference.store.rejections import resolve_rescored_rejections
from inference.store.schema import (
    ResultPath,
    challenger_predictions,
    predictions,
    withdrawn_records,
)
from inference.store.source_rows import _one_of

_TOMBSTONE_SCHEMA = {
    "record_id": pl.String(),
    "partition_date": pl.Date(),
    "entity": pl.String(),
    "event_ts": EVENT_TS_DTYPE,
    "reason": pl.String(),
    "run_id": pl.String(),
    "withdrawn_at": EVENT_TS_DTYPE,
}


class WithdrawalReason(enum.StrEnum):
    NOT_RESENT = "not_resent"  # the re-sent day has no row with its id
    REFUSED_AT_INGEST = "refused_at_ingest"  # the re-sent row could not be stored (see its rejection)


class WithdrawalRefused(ValueError):
    """A re-sent day that would withdraw every stored record of its day: an empty or unreadable
    file (a wrong delimiter) far more often than a day the source retracted whole."""


def withdraw_unsent_records(
    ls: LoadedSpec,
    conn: Connection,
    *,
    partition_date: date,
    kept: pl.Series,
    refused: pl.Series,
    run_id: str | None,
) -> int:
    """Withdraw the day's stored records whose ids are not in `kept` (the rows this ingest stores);
    `refused`: ids among them that the re-sent day sent as rows its ingest refused. Returns how many
    were withdrawn. Raises WithdrawalRefused, writing nothing, when none of the day would be kept."""
    rt = record_table(ls)
    t, w = rt.c, withdrawn_records.c
    stored = conn.execute(sa.select(t[rt.id]).where(t.partition_date == partition_date)).scalars().all()
    tombstoned = conn.execute(sa.select(w.record_id).where(w.partition_date == partition_date)).scalars().all()
    if not stored and not tombstoned:
        return 0  # the day's first ingest: nothing to compare, no ids to collect
    keep = set(kept.to_list())
    for wanted in _one_of(conn, w.record_id, [record_id for record_id in tombstoned if record_id in keep]):
        conn.execute(sa.delete(withdrawn_records).where(wanted))
    gone = [record_id for record_id in stored if record_id not in keep]
    if not gone:
        return 0
    if not keep:
        raise WithdrawalRefused(
            f"the re-sent day {partition_date} has no row that can be stored: refusing to withdraw its "
            f"{len(gone)} stored records (fix the file; a day retracted whole is deleted by hand)"
        )
    refused_ids, now = set(refused.to_list()), utc_now()
    entity = t[rt.entity] if rt.entity is not None else sa.null()
    for wanted in _one_of(conn, t[rt.id], gone):
        rows = conn.execute(sa.select(t[rt.id], entity, t.event_ts).where(wanted)).all()
        tombstones = pl.DataFrame(
            [
                (
                    record_id,
                    partition_date,
                    entity_value,
                    event_ts,
                    (
                        WithdrawalReason.REFUSED_AT_INGEST if record_id in refused_ids else WithdrawalReason.NOT_RESENT
                    ).value,
                    run_id,
                    now,
                )
                for record_id, entity_value, event_ts in rows
            ],
            schema=_TOMBSTONE_SCHEMA,
            orient="row",
        )
        _merge(conn, withdrawn_records, tombstones, ["record_id"], _overwrite)
        conn.execute(sa.delete(rt.table).where(wanted))
    _drop_answers_and_rejections(conn, gone, partition_key=partition_date.isoformat())
    return len(gone)


def _overwrite(excluded: Any) -> tuple[dict[str, Any], Any]:
    """A record withdrawn again (stored again in between) keeps only its latest withdrawal."""
    columns = ("partition_date", "entity", "event_ts", "reason", "run_id", "withdrawn_at")
    return {name: excluded[name] for name in columns}, sa.true()


def _drop_answers_and_rejections(conn: Connection, record_ids: Sequence[str], *, partition_key: str) -> None:
    """Their batch answers (every model version, champion and challenger) go with them; their open
    scoring rejections are over (the quarantined input is no longer the day's)."""
    for table in (predictions, challenger_predictions):
        for wanted in _one_of(conn, table.c.record_id, record_ids):
            conn.execute(sa.delete(table).where(wanted, table.c.path == ResultPath.BATCH.value))
    resolve_rescored_rejections(conn, partition_key=partition_key, record_ids=record_ids)


def withdrawal_row(conn: Connection, record_id: str) -> dict[str, Any] | None:
    """The record's latest withdrawal, if a re-sent day withdrew it and that day has not stored it
    again since (a record another day stores later keeps it: lineage shows both)."""
    statement = sa.select(withdrawn_records).where(withdrawn_records.c.record_id == record_id)
    found = conn.execute(statement).mappings().first()
    return dict(found) if found else None
