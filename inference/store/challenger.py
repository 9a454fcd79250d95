"""`challenger_predictions` and `challenger_reports`: a challenger's answers, stored apart from the
production answers, what challenger_report compares, and the verdicts the promotion gate reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import EVENT_TS_DTYPE
from inference.spec import LoadedSpec
from inference.store.answers import upsert_predictions
from inference.store.engine import _as_utc, _aware, _frame_from_rows
from inference.store.record_table import record_table
from inference.store.schema import (
    ResultPath,
    challenger_predictions,
    challenger_reports,
    predictions,
)

_CHALLENGER_PATHS = {ResultPath.BATCH.value, ResultPath.SHADOW.value}


def upsert_challenger_predictions(conn: Connection, rows: pl.DataFrame) -> int:
    """Write a challenger's answers, with the rules of `upsert_predictions`; path is 'batch' (a
    replay) or 'shadow' (beside an online answer). Returns rows inserted or changed."""
    paths = set(rows["path"].unique().to_list()) if not rows.is_empty() else set()
    if not paths <= _CHALLENGER_PATHS:
        raise ValueError(f"challenger answers are 'batch' or 'shadow', not {sorted(paths - _CHALLENGER_PATHS)}")
    return upsert_predictions(conn, rows, table=challenger_predictions)


COMPARISON_SCHEMA: dict[str, pl.DataType] = {
    "record_id": pl.String(),
    "partition_key": pl.String(),
    # The spec's label where known; null throughout for a spec without one.
    "label": pl.Int64(),
    "champion_score": pl.Float64(),
    "challenger_score": pl.Float64(),
}


def champion_challenger_pairs(
    ls: LoadedSpec,
    conn: Connection,
    *,
    champion: str,
    challenger: str,
    first_day: date,
    last_day: date,
    same_history_length: bool = True,
) -> pl.DataFrame:
    """The batch answers of both versions to the same records of [first_day, last_day]
    (COMPARISON_SCHEMA), with the label where it is known. Only answers to the same inputs pair
    up: a record either version has not scored (a day not replayed yet, a record one version
    rejected), or that was corrected, or whose history changed, since the challenger replayed it
    (the champion's rescore read other inputs) is left out until the replay is run again.

    `same_history_length`: both versions read the same K records of history, so their history
    digests must match too; versions of different K digest different records, and only the
    record itself can be matched."""
    rt = record_table(ls)
    champ, chall, t = predictions.alias("champion"), challenger_predictions.alias("challenger"), rt.c
    label = t[rt.label] if rt.label is not None else sa.null()
    stmt = (
        sa.select(
            chall.c.record_id,
            chall.c.partition_key,
            label,
            champ.c.score,
            chall.c.score,
        )
        .select_from(
            chall.join(
                champ,
                sa.and_(
                    champ.c.record_id == chall.c.record_id,
                    champ.c.model_version == champion,
                    champ.c.path == ResultPath.BATCH.value,
                    champ.c.answer_key == "",
                    champ.c.input_hash == chall.c.input_hash,
                    champ.c.history_hash.is_not_distinct_from(chall.c.history_hash)
                    if same_history_length
                    else sa.true(),
                ),
            ).join(rt.table, t[rt.id] == chall.c.record_id)
        )
        .where(
            chall.c.model_version == challenger,
            chall.c.path == ResultPath.BATCH.value,
            t.partition_date.between(first_day, last_day),
        )
        .order_by(chall.c.record_id)
    )
    return _frame_from_rows(conn.execute(stmt).all(), COMPARISON_SCHEMA)


SHADOW_SCHEMA: dict[str, pl.DataType] = {
    "record_id": pl.String(),
    "champion_latency_ms": pl.Float64(),
    "shadowed": pl.Boolean(),
    "shadow_latency_ms": pl.Float64(),
    "produced_at": EVENT_TS_DTYPE,
}


def online_latencies(conn: Connection, *, champion: str, challenger: str, since: datetime) -> pl.DataFrame:
    """The champion's online answers since `since`, each with its service time and whether the
    challenger shadowed it (and how long that took): what shadowing costs the clients' answers."""
    online, shadow = predictions.alias("online"), challenger_predictions.alias("shadow")
    shadow_match = sa.and_(
        shadow.c.record_id == online.c.record_id,
        shadow.c.request_id == online.c.request_id,
        shadow.c.model_version == challenger,
        shadow.c.path == ResultPath.SHADOW.value,
    )
    stmt = (
        sa.select(
            online.c.record_id,
            online.c.latency_ms,
            shadow.c.record_id.is_not(None),
            shadow.c.latency_ms,
            online.c.produced_at,
        )
        .select_from(online.outerjoin(shadow, shadow_match))
        .where(
            online.c.model_version == champion,
            online.c.path == ResultPath.ONLINE.value,
            online.c.produced_at >= since,
        )
        .order_by(online.c.produced_at, online.c.record_id)
    )
    frame = _frame_from_rows(conn.execute(stmt).all(), SHADOW_SCHEMA)
    return frame.with_columns(_as_utc(pl.col("produced_at")))


def latest_replayed_day(conn: Connection, challenger: str) -> date | None:
    """The newest day the challenger has replayed through the batch path."""
    c = challenger_predictions.c
    newest = conn.execute(
        sa.select(sa.func.max(c.partition_key)).where(c.model_version == challenger, c.path == ResultPath.BATCH.value)
    ).scalar_one_or_none()
    return date.fromisoformat(newest) if newest else None


@dataclass(frozen=True)
class StoredReport:
    report_id: int
    champion: str
    challenger: str
    created_at: datetime
    run_id: str | None
    passed: bool
    failures: dict[str, str]  # check name -> why it failed
    metrics: dict[str, Any]


def record_challenger_report(
    conn: Connection,
    *,
    champion: str,
    challenger: str,
    created_at: datetime,
    run_id: str | None,
    failures: dict[str, str],
    metrics: dict[str, Any],
) -> int:
    result = conn.execute(
        sa.insert(challenger_reports).values(
            champion=champion,
            challenger=challenger,
            created_at=created_at,
            run_id=run_id,
            passed=not failures,
            failures=json.dumps(failures, sort_keys=True),
            metrics=json.dumps(metrics, sort_keys=True, default=str),
        )
    )
    assert result.inserted_primary_key is not None
    return int(result.inserted_primary_key[0])


def latest_challenger_report(conn: Connection, *, challenger: str, champion: str) -> StoredReport | None:
    """The newest report that compared exactly this challenger with exactly this champion."""
    r = challenger_reports.c
    row = (
        conn.execute(
            sa.select(challenger_reports)
            .where(r.challenger == challenger, r.champion == champion)
            .order_by(r.report_id.desc())
            .limit(1)
        )
        .mappings()
        .first()
    )
    if row is None:
        return None
    return StoredReport(
        report_id=int(row["report_id"]),
        champion=str(row["champion"]),
        challenger=str(row["challenger"]),
        created_at=_aware(row["created_at"]),
        run_id=row["run_id"],
        passed=bool(row["passed"]),
        failures=dict(json.loads(row["failures"])),
        metrics=dict(json.loads(row["metrics"])),
    )


def challenger_lineage_rows(conn: Connection, record_id: str) -> list[dict[str, Any]]:
    """Every challenger answer to one record, replays and shadows."""
    c = challenger_predictions.c
    rows = conn.execute(
        sa.select(challenger_predictions).where(c.record_id == record_id).order_by(c.produced_at)
    ).mappings()
    return [dict(row) for row in rows]
