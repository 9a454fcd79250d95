"""A spec's record table, generated from its fields: the one table of Tandem's store whose columns
a team declares (docs/decisions/0012, section 2).

Its columns, in order: the fields (the id the primary key; id, entity, categoricals and the event
time text as received; numerics double precision), `event_ts`, `partition_date`, `reject_reason`,
the label, `input_hash`, `ingested_at`, then, with an entity, where a corrected record stood
before (`previous_{entity}`, `previous_event_ts`). Tandem creates it and never alters it: a
changed spec is a new table (`ModelSpec.table`) or the user's own ALTER.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import polars as pl
import sqlalchemy as sa

from inference.records import EVENT_TS_DTYPE, raw_columns, raw_schema
from inference.spec import LoadedSpec, Numeric

_CORRECTED = "before the last correction of this record; null = never corrected"


# eq=False: hashed by identity, like the LoadedSpec it is built from once, so the statements
# cached per record table cost a pointer lookup on the online path.
@dataclass(frozen=True, eq=False)
class RecordTable:
    """The record table of one spec and the names of the columns the store reads by role."""

    spec: LoadedSpec
    table: sa.Table
    id: str
    entity: str | None
    event_time: str
    label: str | None
    # Where a corrected record stood before: present only with an entity (history is per entity).
    previous_entity: str | None
    raw_columns: tuple[str, ...]
    raw_schema: dict[str, pl.DataType]
    # Stored rows as history for features: the record, its parsed time, and its hash (the digest).
    history_schema: dict[str, pl.DataType]

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def c(self) -> Any:
        """The table's columns (`rt.c[rt.id]`)."""
        return self.table.c

    def order(self) -> tuple[str, ...]:
        """History order: entity (when there is one), event time, id."""
        return (*((self.entity,) if self.entity else ()), "event_ts", self.id)

    def rows_schema(self, *extra: str) -> dict[str, pl.DataType]:
        """RAW + event_ts [+ the label] + `extra` stored columns, as polars reads them."""
        schema: dict[str, pl.DataType] = {**self.raw_schema, "event_ts": EVENT_TS_DTYPE}
        if self.label is not None:
            schema[self.label] = pl.Int16()
        types = {"input_hash": pl.String(), "partition_date": pl.Date()}
        return schema | {name: types[name] for name in extra}


@functools.cache
def record_table(ls: LoadedSpec) -> RecordTable:
    """The spec's record table on a MetaData of its own, built once per spec."""
    entity = ls.entity.name if ls.entity else None
    label = ls.label.name if ls.label else None
    table_name = ls.table
    columns: list[sa.schema.SchemaItem] = [*_field_columns(ls)]
    columns += [
        sa.Column("event_ts", sa.DateTime(timezone=True), nullable=True, comment=f"{ls.event_time.name} parsed, UTC"),
        sa.Column("partition_date", sa.Date, nullable=False, comment="the source day; the Dagster partition"),
        sa.Column("reject_reason", sa.Text, nullable=True, comment="validation result at ingest; null = valid"),
    ]
    if label is not None:
        columns.append(sa.Column(label, sa.SmallInteger, nullable=True, comment="ground truth where known (demo data)"))
    columns += [
        sa.Column("input_hash", sa.Text, nullable=False),
        sa.Column("ingested_at", sa.DateTime(timezone=True), nullable=False),
    ]
    previous_entity = f"previous_{entity}" if entity else None
    if previous_entity is not None:
        # Where the record stood before its last correction: the records that followed it there
        # read it as history, and are stale once it moved as much as those at its new place.
        columns += [
            sa.Column(previous_entity, sa.Text, nullable=True, comment=_CORRECTED),
            sa.Column("previous_event_ts", sa.DateTime(timezone=True), nullable=True, comment=_CORRECTED),
        ]
    columns += [
        sa.Index(f"ix_{table_name}_partition_date", "partition_date"),
        sa.Index(f"ix_{table_name}_ingested_at", "ingested_at"),
    ]
    if entity is not None:
        columns.append(sa.Index(f"ix_{table_name}_entity_event", entity, "event_ts", ls.id.name))
    table = sa.Table(table_name, sa.MetaData(), *columns)
    raw = dict(raw_schema(ls))
    return RecordTable(
        spec=ls,
        table=table,
        id=ls.id.name,
        entity=entity,
        event_time=ls.event_time.name,
        label=label,
        previous_entity=previous_entity,
        raw_columns=raw_columns(ls),
        raw_schema=raw,
        history_schema={**raw, "event_ts": EVENT_TS_DTYPE, "input_hash": pl.String()},
    )


def _field_columns(ls: LoadedSpec) -> list[sa.Column[Any]]:
    columns: list[sa.Column[Any]] = []
    for field in ls.spec.fields:
        if field.name == ls.id.name:
            columns.append(sa.Column(field.name, sa.Text, primary_key=True))
        elif isinstance(field, Numeric):
            columns.append(sa.Column(field.name, sa.Float(precision=53), nullable=True))
        elif field.name == ls.event_time.name:
            columns.append(sa.Column(field.name, sa.Text, nullable=True, comment="as received from the source"))
        else:
            columns.append(sa.Column(field.name, sa.Text, nullable=True))
    return columns


def record_table_ddl(ls: LoadedSpec, dialect: sa.Dialect) -> list[str]:
    """The CREATE statements of the spec's record table in `dialect`'s SQL (`tandem store ddl`)."""
    rt = record_table(ls)
    elements: list[sa.schema.ExecutableDDLElement] = [sa.schema.CreateTable(rt.table)]
    elements += [sa.schema.CreateIndex(index) for index in sorted(rt.table.indexes, key=lambda index: str(index.name))]
    if dialect.supports_comments and not dialect.inline_comments:
        elements += [sa.schema.SetColumnComment(column) for column in rt.table.columns if column.comment]
    return [str(element.compile(dialect=dialect)).strip() for element in elements]
