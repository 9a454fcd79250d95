"""What the batch asset checks read back after a partition's merge: counts across the three
tables, and a sample of batch scores for the parity re-score."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import EVENT_TS_DTYPE
from inference.spec import LoadedSpec
from inference.store.engine import _frame_from_rows
from inference.store.record_table import record_table
from inference.store.schema import RejectStage, ResultPath, predictions, rejected_records


@dataclass(frozen=True)
class PartitionCounts:
    """What the batch asset checks compare, read back from the tables after the merge."""

    input_rows: int
    scored: int
    rejected: int
    scores_out_of_range: int
    stale_answers: int  # batch answers whose input is no longer the stored record's
    answered_online: int  # input rows that the online path answered too (never skipped by batch)
    # Open rows the day's ingest refused (not stored, so not input rows): a day its source sent
    # only as such rows would otherwise read as nothing refused.
    rejected_at_ingest: int = 0

    @property
    def reject_rate(self) -> float:
        """Refused rows of the day, at ingest or at scoring, over the rows received."""
        received = self.input_rows + self.rejected_at_ingest
        return (self.rejected + self.rejected_at_ingest) / received if received else 0.0


def partition_counts(
    ls: LoadedSpec, conn: Connection, *, partition_date: date, partition_key: str, model_version: str
) -> PartitionCounts:
    rt = record_table(ls)
    p, r, t = predictions.c, rejected_records.c, rt.c
    batch_rows = sa.and_(
        p.partition_key == partition_key, p.model_version == model_version, p.path == ResultPath.BATCH.value
    )
    input_rows = conn.execute(sa.select(sa.func.count()).where(t.partition_date == partition_date)).scalar_one()
    scored = conn.execute(sa.select(sa.func.count()).select_from(predictions).where(batch_rows)).scalar_one()
    rejected = conn.execute(
        sa.select(sa.func.count(sa.distinct(r.record_id))).where(
            r.partition_key == partition_key, r.stage == RejectStage.SCORE.value, r.resolved.is_(False)
        )
    ).scalar_one()
    rejected_at_ingest = conn.execute(
        sa.select(sa.func.count()).where(
            r.partition_key == partition_key, r.stage == RejectStage.INGEST.value, r.resolved.is_(False)
        )
    ).scalar_one()
    # NaN compares greater than every number in PostgreSQL, so this also catches non-finite scores.
    out_of_range = conn.execute(
        sa.select(sa.func.count())
        .select_from(predictions)
        .where(batch_rows, sa.not_(sa.and_(p.score >= 0, p.score <= 1)))
    ).scalar_one()
    stale = conn.execute(
        sa.select(sa.func.count())
        .select_from(predictions.join(rt.table, p.record_id == t[rt.id], isouter=True))
        .where(batch_rows, sa.or_(t.input_hash.is_(None), t.input_hash != p.input_hash))
    ).scalar_one()
    answered_online = conn.execute(
        sa.select(sa.func.count(sa.distinct(t[rt.id])))
        .select_from(rt.table.join(predictions, p.record_id == t[rt.id]))
        .where(t.partition_date == partition_date, p.path == ResultPath.ONLINE.value)
    ).scalar_one()
    return PartitionCounts(
        int(input_rows),
        int(scored),
        int(rejected),
        int(out_of_range),
        int(stale),
        int(answered_online),
        int(rejected_at_ingest),
    )


def sample_batch_predictions(
    ls: LoadedSpec, conn: Connection, *, partition_key: str, model_version: str, size: int
) -> pl.DataFrame:
    """A deterministic pseudo-random sample (ordered by input hash) of a partition's batch scores,
    with the stored source rows they came from (RAW columns + event_ts + score)."""
    rt = record_table(ls)
    p, t = predictions.c, rt.c
    stmt = (
        sa.select(*(t[name] for name in rt.raw_columns), t.event_ts, p.score)
        .join_from(predictions, rt.table, p.record_id == t[rt.id])
        .where(p.partition_key == partition_key, p.model_version == model_version, p.path == ResultPath.BATCH.value)
        .order_by(p.input_hash)
        .limit(size)
    )
    schema = {**rt.raw_schema, "event_ts": EVENT_TS_DTYPE, "score": pl.Float64()}
    return _frame_from_rows(conn.execute(stmt).all(), schema)


def batch_scores(conn: Connection, *, partition_key: str, model_version: str) -> list[float]:
    """Every batch score of a partition under `model_version`, for its distribution (metadata)."""
    p = predictions.c
    stmt = sa.select(p.score).where(
        p.partition_key == partition_key, p.model_version == model_version, p.path == ResultPath.BATCH.value
    )
    return [float(score) for score in conn.execute(stmt).scalars()]
