"""The platform names no model's fields: outside the reference's own package (tandem_specs/transactions)
and its tests, a grep for its field names finds nothing. A field name in product code is a place that
serves the reference and silently misreads every other spec; the spec is where such names live.

The frozen migrations 0001-0008 are the one exemption: they are history, and editing them would give
databases at the same revision two shapes (docs/decisions/0012-model-spec.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORM_PACKAGES = ("inference", "serving", "assets", "orchestration", "tandem", "bench")
# The reference's fields, its label and its model class.
REFERENCE_NAMES = (
    "merchant_category",
    "currency",
    "amount",
    "transaction_id",
    "account_id",
    "label_fraud",
    "RiskModel",
)
FROZEN_MIGRATIONS = re.compile(r"inference/migrations/versions/000[1-8]_[a-z0-9_]+\.py")
# Outputs and binaries hold no code: the images the bench draws, Python's caches.
SKIPPED_SUFFIXES = {".png", ".pyc"}
WHOLE_WORD = re.compile(r"\b(" + "|".join(REFERENCE_NAMES) + r")\b")


def platform_files() -> Iterator[Path]:
    for package in PLATFORM_PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            relative = path.relative_to(ROOT).as_posix()
            if not path.is_file() or path.suffix in SKIPPED_SUFFIXES or "__pycache__" in path.parts:
                continue
            if FROZEN_MIGRATIONS.fullmatch(relative):
                continue
            yield path


def hits(text: str) -> Iterator[str]:
    """Each line naming a reference field as a whole word, as `line: text`."""
    for number, line in enumerate(text.splitlines(), start=1):
        if WHOLE_WORD.search(line):
            yield f"{number}: {line.strip()}"


def test_the_grep_finds_a_field_name_as_a_whole_word_only() -> None:
    assert list(hits("key = row['account_id']")) == ["1: key = row['account_id']"]
    assert list(hits("class RiskModel(nn.Module):")) == ["1: class RiskModel(nn.Module):"]
    assert list(hits("amounts, currency_code, transaction_ids, label")) == []


def test_the_scan_covers_every_package_and_exempts_only_the_frozen_migrations() -> None:
    scanned = {path.relative_to(ROOT).as_posix() for path in platform_files()}
    assert {relative.split("/")[0] for relative in scanned} == set(PLATFORM_PACKAGES)
    migrations = sorted((ROOT / "inference/migrations/versions").glob("0*.py"))
    frozen = [path for path in migrations if FROZEN_MIGRATIONS.fullmatch(path.relative_to(ROOT).as_posix())]
    assert len(frozen) == 8
    assert not any(path.relative_to(ROOT).as_posix() in scanned for path in frozen)
    assert all(path.relative_to(ROOT).as_posix() in scanned for path in migrations if path not in frozen)


def test_no_platform_file_names_a_reference_field() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{hit}" for path in platform_files() for hit in hits(path.read_text(encoding="utf-8"))
    ]
    assert not found, "the platform names the reference's fields; take them from the spec:\n" + "\n".join(found)
