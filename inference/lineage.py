"""Why does record X have score Y: every answer each path gave, which one is current, its
producer, model and code version, input and history hashes, and why the paths differ if they do;
every time a path refused it (quarantined: where, when and why); and apart, the challenger's
answers (replays and shadows), which no client ever received."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.engine import Engine

from inference.agreement import cause_of
from inference.spec import LoadedSpec
from inference.store import ResultPath, challenger_lineage_rows, lineage_rows, rejection_rows, withdrawal_row

# `tandem demo` scores a day outside Dagster: its run ids carry this prefix and have no page in its UI.
CLI_RUN_PREFIX = "cli-"


@dataclass(frozen=True)
class ResultLineage:
    model_version: str
    score: float
    path: str
    producer: str
    dagster_run_url: str | None
    request_id: str | None
    batch_id: str | None
    idempotency_key: str | None
    code_version: str
    input_hash: str
    history_hash: str | None
    # The stored source record still has this content; None: no stored record to compare with.
    input_is_current: bool | None
    degraded: bool
    unseen_fields: list[str]
    produced_at: str
    current: bool  # the answer that stands for this record now (see `explain`)
    # Online answers: how the batch answer compares (the same version's, else the newest; None: none yet).
    batch_score: float | None
    versus_batch: str | None  # an inference.agreement.Cause


@dataclass(frozen=True)
class RejectionLineage:
    """A time a path refused the record (`rejected_records`): where, when and why."""

    rejection_id: int
    reason: str  # a validation reason code of the spec, or a source's or the store's reason
    detail: str | None
    path: str  # batch | online
    stage: str  # an inference.store.RejectStage: ingest | score | write
    where: str  # the path, stage and partition (with its Dagster run) or request, in words
    partition_key: str | None
    run_id: str | None
    dagster_run_url: str | None
    request_id: str | None
    received: str  # the record as received, JSON text (NaN and Infinity as sent)
    first_seen: str
    last_seen: str
    seen_count: int
    resolved: bool
    resolution: str | None  # an inference.store.Resolution


@dataclass(frozen=True)
class WithdrawalLineage:
    """A re-sent day no longer held the record: its stored contents and batch answers were deleted."""

    partition_key: str
    reason: str  # an inference.store.WithdrawalReason: not_resent | refused_at_ingest
    withdrawn_at: str
    run_id: str | None
    dagster_run_url: str | None


@dataclass(frozen=True)
class RecordLineage:
    record_id: str
    source_found: bool
    partition_date: str | None
    current_input_hash: str | None
    results: list[ResultLineage]
    # The challenger's answers: path batch (a replay) or shadow; never current, never returned.
    challenger_results: list[ResultLineage]
    # Every quarantine of this id, oldest first: a record refused before it was stored has only these.
    rejections: list[RejectionLineage] = field(default_factory=list)
    withdrawn: WithdrawalLineage | None = None

    @property
    def current(self) -> ResultLineage | None:
        return next((result for result in self.results if result.current), None)

    @property
    def found(self) -> bool:
        """Anything known of the id: a stored record, an answer, a rejection or its withdrawal."""
        return self.source_found or bool(self.results) or bool(self.rejections) or self.withdrawn is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _current_index(rows: list[dict[str, Any]], current_hash: str | None, production_version: str | None) -> int | None:
    """The batch answer for the stored record's current content wins (it read the complete,
    corrected history); without one, the newest online answer for that content; without a stored
    record, the newest answer. Among a path's answers the production model's come first: after a
    rollback its rescore rewrites nothing (the same answer again), so the newest row is the retired
    version's. Rows come oldest first."""
    matching = [i for i, row in enumerate(rows) if current_hash is None or row["input_hash"] == current_hash]
    for path in (ResultPath.BATCH.value, ResultPath.ONLINE.value):
        candidates = [i for i in matching if rows[i]["path"] == path]
        in_production = [i for i in candidates if rows[i]["model_version"] == production_version]
        if candidates:
            return (in_production or candidates)[-1]
    return len(rows) - 1 if rows and current_hash is None else None


def explain(
    ls: LoadedSpec, engine: Engine, record_id: str, *, dagster_ui_url: str, production_version: str | None = None
) -> RecordLineage:
    """`production_version`: the model version in production now (None: unknown), whose answer is
    the current one where several versions answered."""
    with engine.connect() as conn:
        source, rows = lineage_rows(ls, conn, record_id)
        challenger_rows = challenger_lineage_rows(conn, record_id)
        rejected = rejection_rows(conn, record_id)
        withdrawal = withdrawal_row(conn, record_id)
    current_hash = source["input_hash"] if source else None
    # A withdrawn record's answers stay as what was said; none stands for a record no day holds.
    withdrawn = source is None and withdrawal is not None
    current = None if withdrawn else _current_index(rows, current_hash, production_version)
    batch_rows = [row for row in rows if row["path"] == ResultPath.BATCH.value]
    batch_by_version = {row["model_version"]: row for row in batch_rows}
    results = []
    for index, row in enumerate(rows):
        # The pairing rule of path_agreement (store.answer_pairs): the same version's batch answer,
        # else the newest batch answer.
        paired = (
            None
            if row["path"] == ResultPath.BATCH.value
            else batch_by_version.get(row["model_version"], batch_rows[-1] if batch_rows else None)
        )
        results.append(_result(row, current_hash, dagster_ui_url, current=index == current, paired=paired))
    return RecordLineage(
        record_id=record_id,
        source_found=source is not None,
        partition_date=str(source["partition_date"]) if source else None,
        current_input_hash=current_hash,
        results=results,
        challenger_results=[
            _result(row, current_hash, dagster_ui_url, current=False, paired=None) for row in challenger_rows
        ],
        rejections=[_rejection(row, dagster_ui_url) for row in rejected],
        withdrawn=_withdrawal(withdrawal, dagster_ui_url) if withdrawal else None,
    )


def cli_run_id() -> str:
    """The run id of a batch scored by `tandem demo`, outside Dagster."""
    return f"{CLI_RUN_PREFIX}{uuid.uuid4().hex[:12]}"


def _run_name(run_id: str) -> str:
    return f"tandem demo run {run_id}" if run_id.startswith(CLI_RUN_PREFIX) else f"dagster run {run_id}"


def _run_url(dagster_ui_url: str, run_id: str | None) -> str | None:
    """The run's page in Dagster's UI; a `tandem demo` run has none."""
    if not run_id or run_id.startswith(CLI_RUN_PREFIX):
        return None
    return f"{dagster_ui_url.rstrip('/')}/runs/{run_id}"


def _withdrawal(row: dict[str, Any], dagster_ui_url: str) -> WithdrawalLineage:
    return WithdrawalLineage(
        partition_key=str(row["partition_date"]),
        reason=row["reason"],
        withdrawn_at=str(row["withdrawn_at"]),
        run_id=row["run_id"],
        dagster_run_url=_run_url(dagster_ui_url, row["run_id"]),
    )


def _rejection(row: dict[str, Any], dagster_ui_url: str) -> RejectionLineage:
    if row["path"] == ResultPath.BATCH.value:
        run = f" ({_run_name(row['run_id'])})" if row["run_id"] else ""
        where = f"batch {row['stage']} of partition {row['partition_key']}{run}"
    else:
        where = f"{row['path']} {row['stage']} of request {row['request_id']}"
    return RejectionLineage(
        rejection_id=row["rejection_id"],
        reason=row["reason"],
        detail=row["detail"],
        path=row["path"],
        stage=row["stage"],
        where=where,
        partition_key=row["partition_key"],
        run_id=row["run_id"],
        dagster_run_url=_run_url(dagster_ui_url, row["run_id"]),
        request_id=row["request_id"],
        received=row["payload"],
        first_seen=str(row["first_seen"]),
        last_seen=str(row["last_seen"]),
        seen_count=row["seen_count"],
        resolved=bool(row["resolved"]),
        resolution=row["resolution"],
    )


def _result(
    row: dict[str, Any], current_hash: str | None, dagster_ui_url: str, *, current: bool, paired: dict[str, Any] | None
) -> ResultLineage:
    batch = row["path"] == ResultPath.BATCH.value
    return ResultLineage(
        model_version=row["model_version"],
        score=row["score"],
        path=row["path"],
        producer=f"{_run_name(str(row['run_id']))} partition {row['partition_key']}"
        if batch
        else f"request {row['request_id']} batch {row['batch_id']}",
        dagster_run_url=_run_url(dagster_ui_url, row["run_id"]) if batch else None,
        request_id=row["request_id"],
        batch_id=row["batch_id"],
        idempotency_key=row["idempotency_key"],
        code_version=row["code_version"],
        input_hash=row["input_hash"],
        history_hash=row["history_hash"],
        input_is_current=None if current_hash is None else row["input_hash"] == current_hash,
        degraded=bool(row["degraded"]),
        unseen_fields=[name for name in (row["unseen_fields"] or "").split(",") if name],
        produced_at=str(row["produced_at"]),
        current=current,
        batch_score=None if paired is None else paired["score"],
        versus_batch=None if paired is None else cause_of(row, paired).value,
    )
