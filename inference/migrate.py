"""Schema migrations: Alembic for the core tables, driven from code so services and tests need no
alembic.ini; the spec's record table created from the spec, and compared with it on every start."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection, Engine

from inference.spec import LoadedSpec
from inference.store.engine import utc_now
from inference.store.record_table import record_table
from inference.store.schema import tandem_spec

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
_MIGRATION_LOCK_KEY = 7_366_101  # any constant; shared by every Tandem process on one database


class StoreMismatch(ValueError):
    """The database does not hold what the spec says: another spec's, or a record table that
    differs from the spec's. One line, saying what to do."""


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def upgrade(engine: Engine, ls: LoadedSpec) -> None:
    """Bring the core tables to the newest revision and check (or create) the spec's record table,
    in one transaction; safe to call on every start (a no-op when current and equal). Raises
    StoreMismatch when the database belongs to another spec or its record table differs."""
    with _locked(engine) as connection:
        _alembic(connection, "head")
        ensure_record_table(connection, ls)


def upgrade_core(engine: Engine, revision: str = "head") -> None:
    """The core tables alone to `revision` (an older one: the migrations' own tests)."""
    with _locked(engine) as connection:
        _alembic(connection, revision)


@contextlib.contextmanager
def _locked(engine: Engine) -> Iterator[Connection]:
    """A transaction holding the migration lock on PostgreSQL: several processes start at once
    (backfill runs, service workers), and without it they race to CREATE the same tables on a
    fresh database and all but one fail."""
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        yield connection


def _alembic(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def ensure_record_table(connection: Connection, ls: LoadedSpec) -> None:
    """The spec's record table: created when absent, else compared with the spec (names, type
    families, nullability; never altered); and the database's spec recorded, or checked."""
    _check_owner(connection, ls)
    rt = record_table(ls)
    if not sa.inspect(connection).has_table(rt.name):
        rt.table.create(connection)
    else:
        problems = record_table_problems(connection, ls)
        if problems:
            raise StoreMismatch(
                f"record table {rt.name!r} does not match spec {ls.path}: {'; '.join(problems)}; a changed "
                "record schema takes a new table (set ModelSpec.table, e.g. "
                f"'{rt.name}_v2', and backfill it from the source) or alter it yourself "
                "(`tandem store ddl` prints the statements)"
            )
    if connection.execute(sa.select(tandem_spec.c.name)).first() is None:
        connection.execute(
            tandem_spec.insert().values(
                name=ls.spec.name, spec_path=ls.path, record_table=rt.name, recorded_at=utc_now()
            )
        )


def _check_owner(connection: Connection, ls: LoadedSpec) -> None:
    owner = connection.execute(sa.select(tandem_spec.c.name, tandem_spec.c.spec_path)).first()
    if owner is not None and owner.name != ls.spec.name:
        raise StoreMismatch(
            f"this database (DATABASE_URL) belongs to spec {owner.name!r} ({owner.spec_path}), not to "
            f"{ls.spec.name!r} ({ls.path}); point DATABASE_URL at a database of its own for each spec"
        )


def record_table_problems(connection: Connection, ls: LoadedSpec) -> list[str]:
    """How the stored record table differs from the spec's: missing and extra columns, type
    families, nullability ([] when equal)."""
    rt = record_table(ls)
    stored = {column["name"]: column for column in sa.inspect(connection).get_columns(rt.name)}
    problems = []
    for column in rt.table.columns:
        found = stored.get(column.name)
        if found is None:
            problems.append(f"missing column {column.name!r}")
            continue
        wanted, got = _family(column.type), _family(found["type"])
        if wanted != got:
            problems.append(f"{column.name!r} is {got}, the spec says {wanted}")
        if not column.primary_key and bool(found["nullable"]) != bool(column.nullable):
            problems.append(
                f"{column.name!r} is {_nullability(found['nullable'])}, the spec says {_nullability(column.nullable)}"
            )
    problems += [f"column {name!r} is not in the spec" for name in stored if name not in rt.table.c]
    return problems


def _nullability(nullable: Any) -> str:
    return "NULL" if nullable else "NOT NULL"


# A reflected type is named by the first family it is a kind of: a dialect's own spelling (DOUBLE
# PRECISION, SMALLINT, VARCHAR) is the family the spec's type is in, so only a real change differs.
_FAMILIES: tuple[tuple[type[sa.types.TypeEngine[Any]], str], ...] = (
    (sa.DateTime, "TIMESTAMP"),
    (sa.Date, "DATE"),
    (sa.Float, "FLOAT"),
    (sa.Numeric, "FLOAT"),
    (sa.Integer, "INTEGER"),
    (sa.String, "TEXT"),
)


def _family(type_: sa.types.TypeEngine[Any]) -> str:
    return next((name for kind, name in _FAMILIES if isinstance(type_, kind)), type(type_).__name__.upper())
