"""What the sensors watch: partitions a change made stale, rejections an operator fixed, the
partitions scored so far, and what the online path wrote (for the online_predictions observations).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import polars as pl
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from inference.records import EVENT_TS_DTYPE
from inference.spec import LoadedSpec
from inference.store.engine import ByteOrder, _as_utc, _aware
from inference.store.record_table import RecordTable, record_table
from inference.store.schema import (
    Resolution,
    ResultPath,
    challenger_predictions,
    predictions,
    rejected_records,
    withdrawn_records,
)


# ------------------------------------------------------------------ batch partitions to rerun
@dataclass(frozen=True)
class PartitionChange:
    partition_key: str
    watermark: datetime  # the newest change seen in this partition; part of the run key
    # False: every change that touched it already has a batch answer (ingested and scored in one
    # run): it is stale only if its own last batch scoring read the store before `watermark`.
    unanswered: bool = True


def stale_scored_partitions(
    ls: LoadedSpec, conn: Connection, *, changed_after: datetime | None, history_length: int
) -> list[PartitionChange]:
    """Partitions already scored by the batch path that a change may have made stale.

    A change is a record changed (late or corrected) after `changed_after`. Stale are the change's
    own partition and the partitions of the entity's next `history_length` valid records, whose
    features read (or, for a record now invalid, read) the changed one as history. Every such
    partition, however many changed in the same interval, is returned, with the newest change that
    touched it. Without an entity, or at K = 0, no record reads another: only the change's own
    partition.

    A change whose current contents have no batch result yet (no batch prediction and no open
    rejection for its input hash) marks its partitions `unanswered`: stale for certain. A change
    that already has one was scored in the run that ingested it, which says nothing of the later
    days that read it: its partitions are returned too, before a later batch-scored day only (the
    newest day's own ingest-and-score run leaves nothing to judge), for the caller to compare with
    when each was last scored. Those are judged only after a first tick (`changed_after` set): on
    a first one they would be every stored record.

    A record a re-sent day withdrew (`withdrawn_records`) is an unanswered change placed nowhere:
    its own partition, and the entity's records after where it stood, as below.

    A correction that moved the record (another entity, another event time) also makes stale the
    entity's next `history_length` valid records after its old position (`previous_{entity}`,
    `previous_event_ts`): they read it there. Only the last correction's old position is kept: a
    record corrected twice between two ticks leaves the first old position's followers unscheduled.
    """
    rt = record_table(ls)
    changed = _changes(rt, changed_after)
    parts: list[sa.Select[Any]] = [sa.select(changed.c.partition_date, changed.c.ingested_at, changed.c.unanswered)]
    if ls.history_entity(history_length) is not None:
        timeline = _entities_timeline(rt, changed)
        parts += [
            _followers_of_new_place(changed, timeline, history_length),
            _followers_of_old_place(changed, timeline, history_length),
        ]
    touched = sa.union_all(*parts).subquery("touched")
    p = predictions.c
    batch_scored = (
        sa.select(p.record_id)
        .where(p.partition_key == sa.cast(touched.c.partition_date, sa.String), p.path == ResultPath.BATCH.value)
        .exists()
    )
    stmt = (
        sa.select(touched.c.partition_date, sa.func.max(touched.c.ingested_at), sa.func.max(touched.c.unanswered))
        .where(batch_scored)
        .group_by(touched.c.partition_date)
        .order_by(touched.c.partition_date)
    )
    return [
        PartitionChange(str(day), _aware(moment), unanswered=bool(unanswered))
        for day, moment, unanswered in conn.execute(stmt)
    ]


def _changes(rt: RecordTable, changed_after: datetime | None) -> sa.CTE:
    """Records ingested after `changed_after` that may have made a batch-scored partition stale,
    `unanswered` (1) where their current input hash has no batch result yet, with the role columns
    the followers' queries read under fixed names (`record_id`, `entity`, `previous_entity`)."""
    t, p, r = rt.c, predictions.c, rejected_records.c
    record_id = t[rt.id]
    unanswered = sa.and_(
        # Only a batch answer counts: an online answer to the corrected body leaves the batch stale.
        ~sa.select(p.record_id)
        .where(p.record_id == record_id, p.input_hash == t.input_hash, p.path == ResultPath.BATCH.value)
        .exists(),
        ~sa.select(r.rejection_id)
        .where(r.record_id == record_id, r.input_hash == t.input_hash, r.resolved.is_(False))
        .exists(),
    )
    where: list[sa.ColumnElement[bool]] = [unanswered]
    if changed_after is not None:
        newest_scored_day = (
            sa.select(sa.func.max(p.partition_key)).where(p.path == ResultPath.BATCH.value).scalar_subquery()
        )
        where = [
            t.ingested_at > changed_after,
            sa.or_(unanswered, sa.cast(t.partition_date, sa.String) < newest_scored_day),
        ]
    columns: list[sa.ColumnElement[Any]] = [
        record_id.label("record_id"),
        t.partition_date,
        t.ingested_at,
        sa.case((unanswered, 1), else_=0).label("unanswered"),
    ]
    if rt.entity is not None and rt.previous_entity is not None:
        columns += [
            t[rt.entity].label("entity"),
            t[rt.previous_entity].label("previous_entity"),
            t.previous_event_ts,
        ]
    return sa.union_all(sa.select(*columns).where(*where), _withdrawals(rt, changed_after)).cte("changed")


def _withdrawals(rt: RecordTable, withdrawn_after: datetime | None) -> sa.Select[Any]:
    """Records a re-sent day withdrew, as changes: stale for certain (their batch answers went with
    them), placed nowhere now, their old place where they stood (`watch` reads it as a move's)."""
    w = withdrawn_records.c
    columns: list[sa.ColumnElement[Any]] = [
        w.record_id,
        w.partition_date,
        w.withdrawn_at,
        sa.literal(1),
    ]
    if rt.entity is not None and rt.previous_entity is not None:
        columns += [sa.cast(sa.null(), sa.Text), w.entity, w.event_ts]
    where = [w.withdrawn_at > withdrawn_after] if withdrawn_after is not None else []
    return sa.select(*columns).where(*where)


def _entities_timeline(rt: RecordTable, changed: sa.CTE) -> sa.CTE:
    """The affected entities' records in history order: valid ones (what features read) and the
    changed ones themselves (to place them), each with `valid_upto`, the entity's valid records up
    to and including it: the next K valid records after a place are those numbered past it."""
    assert rt.entity is not None
    t = rt.c
    entity, record_id = t[rt.entity], t[rt.id]
    valid = t.reject_reason.is_(None)
    return (
        sa.select(
            record_id.label("record_id"),
            entity.label("entity"),
            t.partition_date,
            t.event_ts,
            sa.case((valid, 1), else_=0).label("valid"),
            sa.func.sum(sa.case((valid, 1), else_=0))
            .over(partition_by=entity, order_by=(t.event_ts, ByteOrder(record_id)))
            .label("valid_upto"),
        )
        .where(
            sa.or_(
                entity.in_(sa.select(changed.c.entity)),
                entity.in_(sa.select(changed.c.previous_entity).where(changed.c.previous_entity.is_not(None))),
            ),
            sa.or_(valid, record_id.in_(sa.select(changed.c.record_id))),
        )
        .cte("timeline")
    )


def _followers_of_new_place(changed: sa.CTE, timeline: sa.CTE, history_length: int) -> sa.Select[Any]:
    """Partitions of the `history_length` valid records after each changed record that is valid
    (an invalid one is no history where it stands; where it stood is `_followers_of_old_place`'s),
    with the change's time."""
    at, later = timeline.alias("at_change"), timeline.alias("later")
    return (
        sa.select(later.c.partition_date, changed.c.ingested_at, changed.c.unanswered)
        .select_from(changed)
        .join(at, sa.and_(at.c.record_id == changed.c.record_id, at.c.valid == 1))
        .join(
            later,
            sa.and_(
                later.c.entity == at.c.entity,
                later.c.valid == 1,
                later.c.valid_upto > at.c.valid_upto,
                later.c.valid_upto <= at.c.valid_upto + history_length,
            ),
        )
    )


def _followers_of_old_place(changed: sa.CTE, timeline: sa.CTE, history_length: int) -> sa.Select[Any]:
    """Where a moved record stood: the first valid record after its old place, and the K from
    there on (one more than K where it moved later within the entity, its new place among them)."""
    after = timeline.alias("after_old")
    old_place = (
        sa.select(
            after.c.entity, changed.c.ingested_at, changed.c.unanswered, sa.func.min(after.c.valid_upto).label("first")
        )
        .select_from(changed)
        .join(
            after,
            sa.and_(
                after.c.entity == changed.c.previous_entity,
                after.c.valid == 1,
                after.c.record_id != changed.c.record_id,
                sa.or_(
                    after.c.event_ts > changed.c.previous_event_ts,
                    sa.and_(
                        after.c.event_ts == changed.c.previous_event_ts,
                        ByteOrder(after.c.record_id) > changed.c.record_id,
                    ),
                ),
            ),
        )
        .group_by(changed.c.record_id, after.c.entity, changed.c.ingested_at, changed.c.unanswered)
        .cte("old_place")
    )
    followers = timeline.alias("followers")
    return (
        sa.select(followers.c.partition_date, old_place.c.ingested_at, old_place.c.unanswered)
        .select_from(old_place)
        .join(
            followers,
            sa.and_(
                followers.c.entity == old_place.c.entity,
                followers.c.valid == 1,
                followers.c.valid_upto >= old_place.c.first,
                followers.c.valid_upto <= old_place.c.first + history_length,
            ),
        )
    )


def fixed_rejection_partitions(conn: Connection, *, resolved_after: datetime | None) -> list[PartitionChange]:
    """Partitions whose quarantined batch records an operator marked fixed after `resolved_after`."""
    r = rejected_records.c
    stmt = (
        sa.select(r.partition_key, sa.func.max(r.resolved_at))
        .where(
            r.path == ResultPath.BATCH.value,
            r.resolved.is_(True),
            r.resolution == Resolution.OPERATOR.value,
            r.partition_key.is_not(None),
        )
        .group_by(r.partition_key)
        .order_by(r.partition_key)
    )
    if resolved_after is not None:
        stmt = stmt.where(r.resolved_at > resolved_after)
    return [PartitionChange(str(key), _aware(moment)) for key, moment in conn.execute(stmt)]


@dataclass(frozen=True)
class OnlineActivity:
    rows: int
    requests: int
    model_versions: dict[str, int]
    latency_ms_p50: float | None
    latency_ms_p99: float | None
    latest: datetime | None


def online_activity(
    conn: Connection, *, produced_after: datetime | None, produced_before: datetime | None = None, shadow: bool = False
) -> OnlineActivity:
    """What the online path wrote produced after `produced_after` and up to `produced_before`, for
    the online_predictions observations; `shadow`: what the challenger answered beside it
    (challenger_predictions, path shadow)."""
    table, path = (challenger_predictions, ResultPath.SHADOW) if shadow else (predictions, ResultPath.ONLINE)
    p = table.c
    where = [p.path == path.value]
    if produced_after is not None:
        where.append(p.produced_at > produced_after)
    if produced_before is not None:
        where.append(p.produced_at <= produced_before)
    rows = conn.execute(sa.select(p.model_version, p.request_id, p.latency_ms, p.produced_at).where(*where)).all()
    if not rows:
        return OnlineActivity(0, 0, {}, None, None, None)
    frame = pl.DataFrame(
        [tuple(r) for r in rows],
        schema={
            "model_version": pl.String(),
            "request_id": pl.String(),
            "latency_ms": pl.Float64(),
            "produced_at": EVENT_TS_DTYPE,
        },
        orient="row",
    ).with_columns(_as_utc(pl.col("produced_at")))
    versions = frame.group_by("model_version").len().sort("model_version")
    latency = frame["latency_ms"].drop_nulls()
    latest = frame["produced_at"].max()
    return OnlineActivity(
        rows=frame.height,
        requests=frame["request_id"].n_unique(),
        model_versions=dict(zip(versions["model_version"].to_list(), versions["len"].to_list(), strict=True)),
        latency_ms_p50=float(latency.quantile(0.5) or 0.0) if latency.len() else None,
        latency_ms_p99=float(latency.quantile(0.99) or 0.0) if latency.len() else None,
        latest=latest if isinstance(latest, datetime) else None,
    )
