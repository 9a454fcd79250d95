"""Why does transaction X have score Y: path, producer, model and code version, input hash, and
whether the batch and online paths agree."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.engine import Engine

from inference.parity import PARITY_TOLERANCE
from inference.store import ResultPath, lineage_rows


@dataclass(frozen=True)
class ResultLineage:
    model_version: str
    score: float
    path: str
    producer: str
    dagster_run_url: str | None
    request_id: str | None
    batch_id: str | None
    code_version: str
    input_hash: str
    input_is_current: bool  # the stored source record still has this content
    produced_at: str
    other_path: str | None
    other_path_score: float | None
    other_path_producer: str | None
    paths_agree: bool | None  # None: only one path has scored this input under this version


@dataclass(frozen=True)
class TransactionLineage:
    transaction_id: str
    source_found: bool
    partition_date: str | None
    current_input_hash: str | None
    results: list[ResultLineage]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def explain(engine: Engine, transaction_id: str, *, dagster_ui_url: str) -> TransactionLineage:
    with engine.connect() as conn:
        source, rows = lineage_rows(conn, transaction_id)
    current_hash = source["input_hash"] if source else None
    results = []
    for row in rows:
        batch = row["path"] == ResultPath.BATCH.value
        producer = (
            f"dagster run {row['run_id']} partition {row['partition_key']}"
            if batch
            else f"request {row['request_id']} batch {row['batch_id']}"
        )
        other_score = row["cross_path_score"]
        results.append(
            ResultLineage(
                model_version=row["model_version"],
                score=row["score"],
                path=row["path"],
                producer=producer,
                dagster_run_url=f"{dagster_ui_url.rstrip('/')}/runs/{row['run_id']}"
                if batch and row["run_id"]
                else None,
                request_id=row["request_id"],
                batch_id=row["batch_id"],
                code_version=row["code_version"],
                input_hash=row["input_hash"],
                input_is_current=row["input_hash"] == current_hash,
                produced_at=str(row["produced_at"]),
                other_path=row["cross_path"],
                other_path_score=other_score,
                other_path_producer=row["cross_path_producer"],
                paths_agree=None if other_score is None else abs(other_score - row["score"]) <= PARITY_TOLERANCE,
            )
        )
    return TransactionLineage(
        transaction_id=transaction_id,
        source_found=source is not None,
        partition_date=str(source["partition_date"]) if source else None,
        current_input_hash=current_hash,
        results=results,
    )
