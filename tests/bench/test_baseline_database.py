"""The baseline's code reads a database at its own schema: the core tables at the newest migration of
its checkout, and Tandem's records copied in, so it scores the same records on the tables it knows."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import sqlalchemy as sa

from bench.baseline import copy_records, head_revision
from inference.batch import ingest_day
from inference.migrate import upgrade
from inference.records import raw_frame
from inference.store import make_engine
from tests.reference import RECORDS, REFERENCE

DAY = date(2026, 11, 1)


def checkout_at(path: Path, revision: int) -> Path:
    """A checkout whose newest migration is `revision` (the files' names are what is read)."""
    versions = path / "inference" / "migrations" / "versions"
    versions.mkdir(parents=True)
    for number in range(1, revision + 1):
        (versions / f"{number:04d}_step.py").write_text("")
    (versions / "__init__.py").write_text("")
    return path


def record(record_id: str) -> dict[str, object]:
    return {
        "transaction_id": record_id,
        "account_id": "acct-1",
        "amount": 12.5,
        "currency": "EUR",
        "merchant_category": "grocery",
        "country": "DE",
        "event_time": f"2026-11-01T10:00:0{record_id[-1]}Z",
    }


def test_head_revision_is_the_newest_migration(tmp_path: Path) -> None:
    assert head_revision(checkout_at(tmp_path, 7)) == "0007"


def test_the_records_are_copied_into_the_baseline_schema(tmp_path: Path) -> None:
    source_url, target_url = f"sqlite:///{tmp_path / 'ours.db'}", f"sqlite:///{tmp_path / 'theirs.db'}"
    source = make_engine(source_url)
    upgrade(source, REFERENCE)
    ingest_day(REFERENCE, source, raw_frame(REFERENCE, [record("tx-1"), record("tx-2")]), DAY)
    source.dispose()

    copy_records(REFERENCE, source_url, target_url, checkout_at(tmp_path / "old", 7))

    target = make_engine(target_url)
    try:
        inspector = sa.inspect(target)
        # 0007's core tables still key predictions by the reference's id, as the baseline reads them.
        assert "transaction_id" in {column["name"] for column in inspector.get_columns("predictions")}
        with target.connect() as conn:
            ids = conn.execute(sa.select(RECORDS.c.transaction_id).order_by(RECORDS.c.transaction_id)).scalars()
            assert list(ids) == ["tx-1", "tx-2"]
    finally:
        target.dispose()
