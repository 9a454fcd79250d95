"""Dagster's standard metadata for Tandem's materializations, and the score distribution the UI shows.

`dagster/row_count` fills the Rows field of the asset page, `dagster/column_schema` its Columns
tab. A partition's rows are counted, not the whole table: a table-wide count would cost a scan on
every run and say nothing about the partition just written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl
import sqlalchemy as sa
from dagster import MetadataValue, TableColumn, TableColumnConstraints, TableRecord, TableSchema
from sqlalchemy.dialects import postgresql

# The decision threshold sits at 0.5; tenths are fine enough to see a shift and coarse enough to read.
HISTOGRAM_BINS = 10
HISTOGRAM_BAR_WIDTH = 40
DECILES = tuple(step / 10 for step in range(11))  # min, p10 ... p90, max
# On a `predictions` materialization: the moment before its scoring first read the store. A record
# ingested later may be missing from what it scored (late_records_sensor compares the two).
STORE_READ_FROM = "store_read_from"


def table_schema(table: sa.Table) -> TableSchema:
    """The columns of a result-store table, as the Columns tab shows them."""
    primary_key = {column.name for column in table.primary_key.columns}
    return TableSchema(
        columns=[
            TableColumn(
                name=column.name,
                type=column.type.compile(dialect=postgresql.dialect()).lower(),
                description=column.comment,
                constraints=TableColumnConstraints(
                    nullable=bool(column.nullable),
                    unique=bool(column.unique) or primary_key == {column.name},
                    other=["primary key"] if column.name in primary_key else [],
                ),
            )
            for column in table.columns
        ]
    )


def frame_schema(schema: Mapping[str, pl.DataType]) -> TableSchema:
    """A report's rows (a polars schema) as a column schema."""
    return TableSchema(columns=[TableColumn(name=name, type=str(dtype).lower()) for name, dtype in schema.items()])


def table_metadata(schema: TableSchema, rows: int) -> dict[str, Any]:
    return {
        "dagster/row_count": MetadataValue.int(rows),
        "dagster/partition_row_count": MetadataValue.int(rows),
        "dagster/column_schema": MetadataValue.table_schema(schema),
    }


def _histogram_markdown(scores: np.ndarray) -> str:
    counts, edges = np.histogram(scores, bins=HISTOGRAM_BINS, range=(0.0, 1.0))
    peak = max(int(counts.max()), 1)
    lines = ["| score | rows | share | |", "| --- | ---: | ---: | --- |"]
    for count, low, high in zip(counts, edges[:-1], edges[1:], strict=True):
        bar = "█" * round(HISTOGRAM_BAR_WIDTH * int(count) / peak)
        closing = "]" if high >= 1.0 else ")"
        lines.append(f"| [{low:.1f}, {high:.1f}{closing} | {int(count)} | {int(count) / scores.size:.1%} | {bar} |")
    return "\n".join(lines)


def score_distribution(scores: Sequence[float]) -> dict[str, Any]:
    """Deciles (a table), a histogram (markdown) and p50/p90/p99 (numbers the UI plots across partitions)."""
    values = np.asarray(scores, dtype=np.float64)
    schema = TableSchema(columns=[TableColumn("quantile", "string"), TableColumn("score", "float")])
    if values.size == 0:
        nan = float("nan")  # nothing scored: no distribution, and 0 would read as a real score
        return {
            "score_deciles": MetadataValue.table(records=[], schema=schema),
            "score_histogram": MetadataValue.md("No rows scored."),
            "score_p50": nan,
            "score_p90": nan,
            "score_p99": nan,
        }
    quantiles = np.quantile(values, DECILES)
    labels = ["min" if q == 0 else "max" if q == 1 else f"p{round(q * 100)}" for q in DECILES]
    return {
        "score_deciles": MetadataValue.table(
            records=[
                TableRecord({"quantile": label, "score": round(float(value), 6)})
                for label, value in zip(labels, quantiles, strict=True)
            ],
            schema=schema,
        ),
        "score_histogram": MetadataValue.md(_histogram_markdown(values)),
        "score_p50": float(np.quantile(values, 0.5)),
        "score_p90": float(np.quantile(values, 0.9)),
        "score_p99": float(np.quantile(values, 0.99)),
    }
