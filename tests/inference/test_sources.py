"""Sources: a user's files (CSV, Parquet, NDJSON; a file or a folder per day), a SQL query, the demo.

A whole-day problem is one SourceError naming the file, the column and the problem; a bad cell
stays a row, for validation to quarantine alone.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
from collections.abc import Callable
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import fsspec
import polars as pl
import pytest
import sqlalchemy as sa

from inference.demo import demo_day
from inference.records import raw_frame, validate
from inference.sources import FileSource, SourceError, SqlSource, demo_path, write_demo_day
from inference.sources.common import PROBLEM
from inference.sources.sql import _label_value
from inference.spec import POISON_REASON, DemoSettings, LoadedSpec, load_spec
from tandem_specs.transactions.demo import DemoConfig, generate_day
from tests.reference import RAW_COLUMNS, RAW_SCHEMA, REFERENCE

DAY = date(2026, 11, 3)
LABEL = "label_fraud"
ROWS: list[dict[str, Any]] = [
    {
        "transaction_id": "u-1",
        "account_id": "a-1",
        "amount": 12.5,
        "currency": "USD",
        "merchant_category": "grocery",
        "country": "US",
        "event_time": "2026-11-03T09:30:00Z",
        "label_fraud": 0,
    },
    {
        "transaction_id": "u-2",
        "account_id": "a-2",
        "amount": 910.0,
        "currency": "EUR",
        "merchant_category": "jewelry",
        "country": "FR",
        "event_time": "2026-11-03T23:59:59.5+00:00",
        "label_fraud": 1,
    },
]
EXPECTED = pl.DataFrame(ROWS, schema={**RAW_SCHEMA, "label_fraud": pl.Int16()})


def _frame(rows: list[dict[str, Any]] = ROWS) -> pl.DataFrame:
    return pl.DataFrame(rows, schema={**RAW_SCHEMA, "label_fraud": pl.Int64()})


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str] | None = None) -> Path:
    """By hand, as a user's export would look, not through polars."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = columns or list(rows[0])
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        writer.writerows([[row.get(name, "") for name in names] for row in rows])
    return path


WRITERS: dict[str, Callable[[pl.DataFrame, Path], None]] = {
    "csv": lambda frame, path: frame.write_csv(path),
    "parquet": lambda frame, path: frame.write_parquet(path),
    "ndjson": lambda frame, path: frame.write_ndjson(path),
}


def _raises(source: FileSource, *fragments: str) -> str:
    with pytest.raises(SourceError) as caught:
        source.read(DAY)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.mark.parametrize("fmt", ["csv", "parquet", "ndjson"])
def test_a_day_file_reads_as_raw_records_with_its_label(tmp_path: Path, fmt: str) -> None:
    WRITERS[fmt](_frame().with_columns(note=pl.lit("ignored")), tmp_path / f"2026-11-03.{fmt}")
    source = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}." + fmt)

    read = source.read(DAY)

    assert read.frame.equals(EXPECTED), read.frame
    assert read.kind == "files"
    assert read.paths == (str(tmp_path / f"2026-11-03.{fmt}"),)
    assert read.version == source.versions()[DAY]
    assert source.records_for(DAY).equals(EXPECTED)


def test_without_a_label_column_only_raw_columns_come_back(tmp_path: Path) -> None:
    _write_csv(tmp_path / "2026-11-03.csv", ROWS, columns=list(RAW_COLUMNS))
    assert FileSource(REFERENCE, str(tmp_path)).read(DAY).frame.equals(EXPECTED.drop("label_fraud"))


def test_a_day_folder_reads_every_file_of_its_format_in_name_order(tmp_path: Path) -> None:
    folder = tmp_path / "20261103"
    folder.mkdir()
    first, second = _frame(ROWS[:1]), _frame(ROWS[1:])
    second.write_parquet(folder / "part-1.parquet")
    first.write_parquet(folder / "part-0.parquet")
    first.write_parquet(folder / ".part-2.parquet.tmp")  # a writer's temporary file
    (folder / "_SUCCESS").write_text("")
    (folder / "notes.txt").write_text("not data")
    source = FileSource(REFERENCE, str(tmp_path), "{date:%Y%m%d}/", "parquet")

    read = source.read(DAY)

    assert read.frame.equals(EXPECTED)
    assert read.paths == (str(folder / "part-0.parquet"), str(folder / "part-1.parquet"))
    assert source.versions() == {DAY: read.version}


def test_gzip_part_files_are_read_and_versioned_and_bookkeeping_files_passed_over(tmp_path: Path) -> None:
    """Before, `part-0001.csv.gz` was passed over without a word: its rows were missing from the day."""
    folder = tmp_path / "2026-11-03"
    _write_csv(folder / "part-0000.csv", ROWS[:1])
    plain = io.BytesIO()
    _frame(ROWS[1:]).write_ndjson(plain)
    (folder / "part-0001.ndjson.gz").write_bytes(gzip.compress(plain.getvalue()))
    for name in ("_SUCCESS", ".part-0000.csv.crc", "README.md"):
        (folder / name).write_text("")
    source = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}/")

    read = source.read(DAY)

    assert [Path(path).name for path in read.paths] == ["part-0000.csv", "part-0001.ndjson.gz"]
    assert read.frame.equals(EXPECTED), read.frame
    before = source.versions()[DAY]
    (folder / "part-0001.ndjson.gz").write_bytes(gzip.compress(plain.getvalue() * 2))
    assert source.versions()[DAY] != before


@pytest.mark.parametrize("name", ["part-0001.csv.zst", "part-0001.json", "part-0001.csv.bz2"])
def test_a_data_file_of_a_kind_not_read_fails_the_day_by_name(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "2026-11-03"
    _write_csv(folder / "part-0000.csv", ROWS)
    (folder / name).write_bytes(b"\x28\xb5\x2f\xfd")
    _raises(FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}/"), str(folder / name), "does not read")


def test_a_truncated_gzip_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "2026-11-03.csv.gz"
    path.write_bytes(gzip.compress(b"transaction_id,account_id\nu-1,a-1\n" * 50)[:40])
    _raises(FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.csv.gz"), str(path), "cannot be read as csv")


def test_a_compact_date_pattern_is_parsed_back_from_file_names(tmp_path: Path) -> None:
    for day in ("20261101", "20261103"):
        _write_csv(tmp_path / f"tx_{day}.csv", ROWS)
    _write_csv(tmp_path / "tx_20261399.csv", ROWS)  # no such date
    _write_csv(tmp_path / "tx_2026110.csv", ROWS)  # not the pattern
    source = FileSource(REFERENCE, str(tmp_path), "tx_{date:%Y%m%d}.csv")

    assert source.list_days() == [date(2026, 11, 1), DAY]
    assert source.read(DAY).frame.equals(EXPECTED)


def test_nested_date_folders(tmp_path: Path) -> None:
    _write_csv(tmp_path / "2026" / "11" / "03.csv", ROWS)
    source = FileSource(REFERENCE, str(tmp_path), "{date:%Y}/{date:%m}/{date:%d}.csv")
    assert source.list_days() == [DAY]
    assert source.read(DAY).frame.equals(EXPECTED)


def test_a_missing_day_is_an_error_not_an_empty_day(tmp_path: Path) -> None:
    _write_csv(tmp_path / "2026-11-03.csv", ROWS)
    with pytest.raises(SourceError, match=r"^no file for 2026-11-08 at .*2026-11-08\.csv$"):
        FileSource(REFERENCE, str(tmp_path)).read(date(2026, 11, 8))
    with pytest.raises(SourceError, match="no folder for 2026-11-08"):
        FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}/").read(date(2026, 11, 8))
    (tmp_path / "2026-11-04").mkdir()
    with pytest.raises(SourceError, match="no csv files in the folder for 2026-11-04"):
        FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}/", "csv").read(date(2026, 11, 4))


def test_a_missing_column_names_the_file_and_the_column(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "2026-11-03.csv", ROWS, columns=[c for c in RAW_COLUMNS if c != "currency"])
    _raises(FileSource(REFERENCE, str(tmp_path)), str(path), "'currency'", "missing")


def _read_as_written(folder: Path, header: list[str]) -> pl.DataFrame:
    """ROWS under this header, a column per name, each name's cells those of its stripped name."""
    path = _write_csv(folder / "2026-11-03.csv", ROWS, columns=[name.strip() for name in header])
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(",".join(header) + "\r\n" + "".join(lines[1:]))
    return FileSource(REFERENCE, str(folder)).read(DAY).frame


def test_blanks_around_header_names_are_not_part_of_the_names(tmp_path: Path) -> None:
    padded = [f" {name} " if i % 2 else name for i, name in enumerate([*RAW_COLUMNS, LABEL])]
    read = _read_as_written(tmp_path / "padded", padded)
    assert read.equals(_read_as_written(tmp_path / "plain", [*RAW_COLUMNS, LABEL]))
    assert read.columns == [*RAW_COLUMNS, LABEL] and read.height == len(ROWS)


@pytest.mark.parametrize("header", ["amount", "amount ", "label_fraud"])
def test_a_required_column_given_twice_is_the_files_error(tmp_path: Path, header: str) -> None:
    """Either copy could be the one meant: reading the first would be a silent guess."""
    path = _write_csv(tmp_path / "2026-11-03.csv", ROWS, columns=[*RAW_COLUMNS, LABEL, header])
    _raises(FileSource(REFERENCE, str(tmp_path)), str(path), repr(header.strip()), "given more than once")


def test_two_extra_columns_of_one_name_are_ignored_like_any_extra_column(tmp_path: Path) -> None:
    read = _read_as_written(tmp_path / "extra", [*RAW_COLUMNS, LABEL, "note", " note"])
    assert read.equals(_read_as_written(tmp_path / "plain", [*RAW_COLUMNS, LABEL]))


def test_a_file_separated_by_semicolons_says_so(tmp_path: Path) -> None:
    path = tmp_path / "2026-11-03.csv"
    path.write_text(";".join(RAW_COLUMNS) + "\n" + ";".join(str(ROWS[0][c]) for c in RAW_COLUMNS) + "\n")
    _raises(FileSource(REFERENCE, str(tmp_path)), str(path), "'transaction_id': missing", "looks separated by ';'")


@pytest.mark.parametrize(
    ("fmt", "column", "value", "problem"),
    [
        ("parquet", "amount", pl.lit("12.50"), "expected a number, found String"),
        ("parquet", "currency", pl.lit(3), "expected text, found Int32"),
        ("parquet", "event_time", pl.lit(datetime(2026, 11, 3, 9, 30)), "timestamp without a time zone"),
    ],
)
def test_a_wrongly_typed_column_names_the_file_the_column_and_the_type(
    tmp_path: Path, fmt: str, column: str, value: pl.Expr, problem: str
) -> None:
    path = tmp_path / f"2026-11-03.{fmt}"
    WRITERS[fmt](_frame().with_columns(value.alias(column)), path)
    _raises(FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}." + fmt), str(path), repr(column), problem)


def test_a_timezone_aware_timestamp_column_is_stored_as_canonical_utc_text(tmp_path: Path) -> None:
    moment = pl.lit(datetime(2026, 11, 3, 10, 30, tzinfo=UTC)).dt.convert_time_zone("Europe/Paris")
    _frame().with_columns(event_time=moment).write_parquet(tmp_path / "2026-11-03.parquet")
    frame = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.parquet").read(DAY).frame
    assert frame["event_time"].to_list() == ["2026-11-03T10:30:00.000000Z"] * 2


@pytest.mark.parametrize(
    ("fmt", "content"),
    [("parquet", b"PAR1 this is not parquet"), ("ndjson", b'{"transaction_id": "u-1", '), ("csv", b"")],
)
def test_an_unreadable_file_names_the_file_and_the_problem(tmp_path: Path, fmt: str, content: bytes) -> None:
    path = tmp_path / f"2026-11-03.{fmt}"
    path.write_bytes(content)
    _raises(FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}." + fmt), str(path), f"cannot be read as {fmt}")


def test_bad_cells_in_a_csv_are_rows_for_validation_to_reject(tmp_path: Path) -> None:
    good = ROWS[0]
    rows = [
        good,
        {**good, "transaction_id": "bad-amount", "amount": "12,50"},
        {**good, "transaction_id": "no-amount", "amount": ""},
        {**good, "transaction_id": "nan-amount", "amount": "NaN"},
        {**good, "transaction_id": "bad-time", "event_time": "yesterday"},
        {**good, "transaction_id": "no-time", "event_time": ""},
        {**good, "transaction_id": "bad-label", "label_fraud": "maybe"},
        {**good, "transaction_id": "", "account_id": "a-9"},
    ]
    _write_csv(tmp_path / "2026-11-03.csv", rows)

    checked = validate(REFERENCE, FileSource(REFERENCE, str(tmp_path)).read(DAY).frame)

    keys = checked["account_id"] + ":" + checked["transaction_id"].fill_null("")
    reasons = dict(zip(keys, checked["reject_reason"], strict=True))
    assert reasons == {
        "a-1:u-1": None,
        "a-1:bad-amount": "amount_unparsable",
        "a-1:no-amount": "amount_not_finite",
        "a-1:nan-amount": "amount_not_finite",
        "a-1:bad-time": "timestamp_unparsable",
        "a-1:no-time": "timestamp_missing",
        "a-1:bad-label": None,  # a label is ground truth, not an input: unknown, not poison
        "a-9:": "missing_field",
    }
    assert checked.filter(pl.col("transaction_id") == "bad-label")["label_fraud"].to_list() == [None]


LABELS_AS_WRITTEN = ["1", "0", " 1 ", "1.0", "0.0", "", "7", "-1", "yes", "0.5"]
LABELS_AS_READ = [1, 0, 1, 1, 0, None, None, None, None, None]


@pytest.mark.parametrize("fmt", ["csv", "ndjson"])
def test_a_label_other_than_0_or_1_is_not_known_and_never_a_class(tmp_path: Path, fmt: str) -> None:
    """7 was stored and handed to the loss as a class; "1.0" (a float column's export) was lost."""
    rows = [{**ROWS[0], "transaction_id": f"u-{i}", LABEL: label} for i, label in enumerate(LABELS_AS_WRITTEN)]
    if fmt == "csv":
        _write_csv(tmp_path / "2026-11-03.csv", rows)
    else:
        (tmp_path / "2026-11-03.ndjson").write_text("".join(json.dumps(row) + "\n" for row in rows))
    frame = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}." + fmt).read(DAY).frame
    assert frame[LABEL].to_list() == LABELS_AS_READ
    typed = pl.DataFrame([{**ROWS[0], "transaction_id": f"t-{i}", LABEL: v} for i, v in enumerate([1, 0, 7, -1])])
    typed.write_parquet(tmp_path / "2026-11-04.parquet")
    read = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.parquet").read(date(2026, 11, 4)).frame
    assert read[LABEL].to_list() == [1, 0, None, None]
    assert [_label_value(v) for v in (True, Decimal("1"), 0.0, "1.0", 7, "yes", None)] == [1, 1, 0, 1, None, None, None]


@pytest.mark.parametrize("ragged", [False, True], ids=["read-whole", "read-by-line"])
def test_a_blank_csv_line_is_no_record(tmp_path: Path, ragged: bool) -> None:
    """A blank line (the one an editor leaves at the end, or a spreadsheet's row of bare
    separators) is passed over by both CSV readers: quarantined as a record, it counted against
    the day's reject rate. A row with any value is still a row."""
    header = ",".join(RAW_COLUMNS)
    good = "u-1,a-1,12.5,EUR,grocery,DE,2026-11-03T09:30:00+01:00"
    lines = [header, good, "", " ,  ,", ",,,,,,", "u-2,a-1,13.5,EUR,grocery,DE,2026-11-03T10:30:00+01:00"]
    lines += ["u-3,a-1,1,EUR,grocery,DE,2026-11-03T11:00:00+01:00,one cell too many"] if ragged else []
    lines += [",,,,,,not-a-time", "", ""]
    (tmp_path / "2026-11-03.csv").write_text("\r\n".join(lines) + "\r\n")

    frame = FileSource(REFERENCE, str(tmp_path)).read(DAY).frame

    assert frame.height == 3 + ragged, frame
    assert frame["transaction_id"].to_list() == ["u-1", "u-2", *([None] if ragged else []), None]
    if ragged:  # the line numbers count the blank lines: they are the file's own
        assert frame[PROBLEM].to_list()[:2] == [None, None]
        assert frame[PROBLEM][2].startswith("line 7: 8 cells, the header has 7")
    assert validate(REFERENCE, frame)["reject_reason"].to_list()[-1] == "missing_field"


def test_an_ndjson_value_that_cannot_be_read_as_written_is_one_rows_problem(tmp_path: Path) -> None:
    """Each line arrives as written. Before, one off-type value failed the day (an amount `"12.5"`
    or `true`, the `NaN` Python's json writes, `1e999`, a BOM, a line that is not JSON) or was turned
    into text and scored (`false` or `5411` as a category, `true` as an id: a request is refused 422).
    A JSON string amount is its row's problem, as it is a request's."""
    good = {key: value for key, value in ROWS[0].items() if key != "label_fraud"}
    line = '{"transaction_id": "%s", "account_id": "a-1", "amount": %s, "currency": "USD", ' + (
        '"merchant_category": %s, "country": "US", "event_time": "2026-11-03T09:30:00Z"}'
    )
    lines = [
        b"\xef\xbb\xbf" + json.dumps(good).encode(),
        (line % ("as-text", '"12.5"', '"grocery"')).encode(),
        (line % ("as-true", "true", '"grocery"')).encode(),
        (line % ("nan", "NaN", '"grocery"')).encode(),
        (line % ("huge", "1e999", '"grocery"')).encode(),
        (line % ("cat-false", "1.0", "false")).encode(),
        (line % ("cat-number", "1.0", "5411")).encode(),
        json.dumps({**good, "transaction_id": True}).encode(),
        b'{"transaction_id": "cut", "amount": ',
        (line % ("latin-1", "1.0", '"caf\xe9"')).encode("latin-1"),
        b"",
        json.dumps({**good, "transaction_id": "last"}).encode(),
    ]
    (tmp_path / "2026-11-03.ndjson").write_bytes(b"\n".join(lines) + b"\n")

    frame = FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.ndjson").read(DAY).frame
    checked = validate(REFERENCE, frame)

    assert checked.height == 11  # every line but the blank one is a row
    problems = dict(enumerate(checked["source_problem"]))
    reasons = checked["reject_reason"].to_list()
    assert checked["transaction_id"].to_list()[:2] == ["u-1", "as-text"]
    assert reasons[0] is None
    assert problems[1] == 'line 2: amount: "12.5" is a JSON string, not a number'  # a request's "12.5" is a 422
    assert problems[0] is problems[3] is problems[4] is problems[10] is None
    assert reasons[3:5] == ["amount_not_finite"] * 2  # the user's data, refused by validation
    assert problems[2] == "line 3: amount: true is a JSON boolean, not a number"
    assert problems[5] == "line 6: merchant_category: false is a JSON boolean, not text"
    assert problems[6] == "line 7: merchant_category: 5411 is a JSON number, not text"
    assert problems[7] == "line 8: transaction_id: true is a JSON boolean, not text"
    assert problems[8] is not None and problems[8].startswith("line 9: not JSON (")
    assert problems[9] is not None and problems[9].startswith("line 10: not UTF-8 (")
    assert problems[9].endswith('"caf\\xe9", "country": "US", "event_time": "2026-11-03T09:30:00Z"}')
    # Validation alone refuses them too: the unreadable value is null, never its text.
    assert all(reasons[i] is not None for i in (2, 5, 6, 7, 8, 9))
    assert checked["merchant_category"][5] is None and checked["transaction_id"][7] is None
    assert checked["transaction_id"][10] == "last" and reasons[10] is None


def test_an_ndjson_field_wrong_on_every_line_is_each_rows_problem(tmp_path: Path) -> None:
    """Not the file's error: a one-line correction file would fail its day for what is one
    quarantined row in a larger file."""
    path = tmp_path / "2026-11-03.ndjson"
    path.write_text(json.dumps({**ROWS[0], "amount": "12.5", "event_time": 1_793_000_000}) + "\n")
    checked = validate(REFERENCE, FileSource(REFERENCE, str(tmp_path), "{date:%Y-%m-%d}.ndjson").read(DAY).frame)
    assert checked["source_problem"].to_list() == [
        'line 1: amount: "12.5" is a JSON string, not a number; event_time: 1793000000 is a JSON number, not text'
    ]


def test_a_csv_line_that_cannot_be_read_as_written_is_one_rows_problem(tmp_path: Path) -> None:
    """Before, one unquoted comma (`Home, Garden`) or one Latin-1 byte failed the whole day."""
    header = b"transaction_id,account_id,amount,currency,merchant_category,country,event_time,note\n"
    good = b"u-%d,a-1,12.5,USD,grocery,US,2026-11-03T09:30:00Z,\n"
    lines = [
        good % 1,
        b"u-2,a-1,1.0,USD,Home, Garden,US,2026-11-03T09:30:00Z,x\n",
        b"u-3,a-1,1.0,USD,caf\xe9,US,2026-11-03T09:30:00Z,\n",
        b"u-4,a-1,1.0,USD,grocery,US,2026-11-03T09:30:00Z,caf\xe9\n",  # in a column that is not read
        b'u-5,a-1,1.0,USD,Home & Garden,US,2026-11-03T09:30:00Z,"two\nlines, quoted"\n',
        good % 6,
    ]
    (tmp_path / "2026-11-03.csv").write_bytes(header + b"".join(lines))

    checked = validate(REFERENCE, FileSource(REFERENCE, str(tmp_path)).read(DAY).frame)

    assert checked["source_problem"].to_list() == [
        None,
        "line 3: 9 cells, the header has 8: u-2,a-1,1.0,USD,Home, Garden,US,2026-11-03T09:30:00Z,x",
        "line 4: not UTF-8 in merchant_category: u-3,a-1,1.0,USD,caf\\xe9,US,2026-11-03T09:30:00Z,",
        None,
        None,
        None,
    ]
    assert checked["transaction_id"].to_list() == [None if i == 2 else f"u-{i}" for i in range(1, 7)]
    assert checked["merchant_category"][2] is None  # never the text with a replacement character
    assert checked["merchant_category"][4] == "Home & Garden"
    assert [reason is None for reason in checked["reject_reason"]] == [True, False, False, True, True, True]


def test_the_version_of_a_day_changes_when_its_file_does(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "2026-11-03.csv", ROWS)
    os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    source = FileSource(REFERENCE, str(tmp_path))
    before = source.versions()
    assert before == source.versions() == {DAY: source.read(DAY).version}

    _write_csv(path, [*ROWS, {**ROWS[0], "transaction_id": "u-3"}])
    os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    grown = source.versions()
    assert grown[DAY] != before[DAY]  # same mtime, another size

    os.utime(path, ns=(1_700_000_001_000_000_000, 1_700_000_001_000_000_000))
    assert source.versions()[DAY] not in (before[DAY], grown[DAY])  # touched

    _write_csv(tmp_path / "2026-11-04.csv", ROWS)
    assert source.versions().keys() == {DAY, date(2026, 11, 4)}
    assert FileSource(REFERENCE, str(tmp_path / "nowhere")).versions() == {}


def test_an_object_store_url_is_read_through_fsspec() -> None:
    fs = fsspec.filesystem("memory")
    root = "memory://tandem-sources-test/landing"
    try:
        with fs.open(f"{root}/2026-11-03/part-0.csv", "wb") as handle:
            _frame().write_csv(handle)
        with fs.open(f"{root}/2026-11-05/part-0.csv", "wb") as handle:
            _frame().write_csv(handle)
        source = FileSource(REFERENCE, root, "{date:%Y-%m-%d}/")

        read = source.read(DAY)

        assert read.frame.equals(EXPECTED)
        assert read.paths == (f"{root}/2026-11-03/part-0.csv",)
        versions = source.versions()
        assert versions.keys() == {DAY, date(2026, 11, 5)}
        assert versions[DAY] == read.version
        with pytest.raises(SourceError, match=f"no folder for 2026-11-04 at {root}/2026-11-04"):
            source.read(date(2026, 11, 4))
    finally:
        fs.rm("/tandem-sources-test", recursive=True)


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("{day}.csv", "only {date}"),
        ("{date:%H}.csv", "%H is not supported"),
        ("{date:%Y-%m}.csv", "must name the year, month and day"),
        ("{date.year}.csv", "only {date}"),
    ],
)
def test_a_pattern_that_cannot_name_a_day_is_refused(tmp_path: Path, pattern: str, problem: str) -> None:
    with pytest.raises(SourceError, match=problem):
        FileSource(REFERENCE, str(tmp_path), pattern)


# SQL -----------------------------------------------------------------------------------------


def _source_table(url: str) -> sa.Table:
    """A user's table: one row the day before, two on the day, one the day after (boundary)."""
    postgres = url.startswith("postgresql")
    metadata = sa.MetaData()
    table = sa.Table(
        "payments",
        metadata,
        sa.Column("transaction_id", sa.String, primary_key=True),
        sa.Column("account_id", sa.String),
        sa.Column("amount", sa.Numeric(12, 2)),
        sa.Column("currency", sa.String),
        sa.Column("merchant_category", sa.String),
        sa.Column("country", sa.String),
        sa.Column("event_time", sa.DateTime(timezone=True) if postgres else sa.String),
        sa.Column("label_fraud", sa.Integer),
        sa.Column("internal_note", sa.String),
    )
    moments = {
        "before": datetime(2026, 11, 2, 23, 59, 59, tzinfo=UTC),
        "u-1": datetime(2026, 11, 3, 9, 30, tzinfo=UTC),
        "u-2": datetime(2026, 11, 3, 23, 59, 59, 500000, tzinfo=UTC),
        "after": datetime(2026, 11, 4, tzinfo=UTC),
    }
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            metadata.create_all(conn)
            base = {k: v for k, v in ROWS[0].items() if k not in ("transaction_id", "event_time")}
            for transaction_id, moment in moments.items():
                row = ROWS[1] if transaction_id == "u-2" else base
                conn.execute(
                    table.insert().values(
                        **{k: v for k, v in row.items() if k not in ("transaction_id", "event_time")},
                        transaction_id=transaction_id,
                        event_time=moment if postgres else moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                        internal_note="x",
                    )
                )
    finally:
        engine.dispose()
    return table


COLUMNS = "transaction_id, account_id, amount, currency, merchant_category, country, event_time, label_fraud"


def test_a_sql_query_reads_the_partitions_time_window(database_url: str) -> None:
    _source_table(database_url)
    if database_url.startswith("postgresql"):
        where = "event_time >= :start AND event_time < :end"
    else:  # ISO text in SQLite: compare as instants
        where = "julianday(event_time) >= julianday(:start) AND julianday(event_time) < julianday(:end)"
    source = SqlSource(
        REFERENCE, database_url, f"SELECT {COLUMNS}, internal_note FROM payments WHERE {where} ORDER BY 1"
    )

    read = source.read(DAY)

    expected = EXPECTED.with_columns(
        event_time=pl.Series(["2026-11-03T09:30:00.000000Z", "2026-11-03T23:59:59.500000Z"])
    )
    assert read.frame.equals(expected), read.frame
    assert read.kind == "sql" and read.version is None


def test_a_sql_query_can_use_the_day(sqlite_url: str) -> None:
    _source_table(sqlite_url)
    source = SqlSource(REFERENCE, sqlite_url, f"SELECT {COLUMNS} FROM payments WHERE substr(event_time, 1, 10) = :day")
    assert source.records_for(DAY)["transaction_id"].sort().to_list() == ["u-1", "u-2"]


def test_a_sql_result_without_a_raw_column_names_it(sqlite_url: str) -> None:
    _source_table(sqlite_url)
    source = SqlSource(
        REFERENCE, sqlite_url, "SELECT transaction_id, account_id, amount, currency, country FROM payments"
    )
    with pytest.raises(SourceError, match=r"query on sqlite:///.*: column 'merchant_category': missing"):
        source.read(DAY)


def test_a_sql_query_that_fails_is_a_source_error(sqlite_url: str) -> None:
    _source_table(sqlite_url)
    with pytest.raises(SourceError, match="the query failed"):
        SqlSource(REFERENCE, sqlite_url, f"SELECT {COLUMNS} FROM payments WHERE").read(DAY)


@pytest.mark.postgres
def test_a_sql_timestamp_without_time_zone_is_refused(postgres_url: str) -> None:
    _source_table(postgres_url)
    query = f"SELECT {COLUMNS.replace('event_time', 'event_time::timestamp AS event_time')} FROM payments"
    with pytest.raises(SourceError, match="column 'event_time': timestamp without a time zone"):
        SqlSource(REFERENCE, postgres_url, query).read(DAY)


# The demo ------------------------------------------------------------------------------------


def test_the_demo_day_written_to_the_landing_folder_reads_back_as_generated(tmp_path: Path) -> None:
    settings = DemoSettings(seed=7, rows_per_day=600, poison_rate=0.05)
    path, written = write_demo_day(REFERENCE, tmp_path, DAY, settings)
    assert written and path == tmp_path / "2026-11-03.csv"
    stat = path.stat()

    again, written_again = write_demo_day(REFERENCE, tmp_path, DAY, settings)

    assert (again, written_again) == (path, False)
    assert path.stat().st_mtime_ns == stat.st_mtime_ns  # untouched: its version stays the same
    assert [p.name for p in tmp_path.iterdir()] == ["2026-11-03.csv"]  # no temporary file left behind
    generated = generate_day(DAY, DemoConfig(seed=7, rows_per_day=600, poison_rate=0.05))
    back = FileSource(REFERENCE, str(tmp_path)).read(DAY).frame
    assert back.equals(generated.drop("poison_kind").with_columns(pl.col("label_fraud").cast(pl.Int16)))
    # Every poison row is rejected for the same reason after the round trip through CSV.
    assert validate(REFERENCE, back)["reject_reason"].equals(validate(REFERENCE, generated)["reject_reason"])


def test_the_demo_writes_a_day_folder_when_the_pattern_names_one(tmp_path: Path) -> None:
    settings = DemoSettings(seed=3, rows_per_day=100, poison_rate=0.0)
    path, _ = write_demo_day(REFERENCE, tmp_path, DAY, settings, "{date:%Y%m%d}/")
    assert path == demo_path(tmp_path, DAY, "{date:%Y%m%d}/") == tmp_path / "20261103" / "demo.csv"
    assert FileSource(REFERENCE, str(tmp_path), "{date:%Y%m%d}/").read(DAY).frame.height == 100


@pytest.mark.parametrize("driver", ["psycopg", "psycopg2"])
@pytest.mark.parametrize("moment", ["infinity", "-infinity", "10000-01-01 00:00:00+00"])
def test_a_sql_time_no_python_datetime_holds_is_one_rows_problem(postgres_url: str, driver: str, moment: str) -> None:
    """Before, psycopg failed the whole day on one such row, blaming the query; psycopg2 read
    'infinity' as 9999-12-31 and '-infinity' as the year 1, and the row was scored."""
    url = sa.engine.make_url(postgres_url).set(drivername=f"postgresql+{driver}").render_as_string(False)
    _source_table(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE payments SET event_time = :moment WHERE transaction_id = 'u-2'"), {"moment": moment}
        )
    engine.dispose()
    query = f"SELECT {COLUMNS} FROM payments WHERE transaction_id IN ('u-1', 'u-2') ORDER BY transaction_id"

    checked = validate(REFERENCE, SqlSource(REFERENCE, url, query).read(DAY).frame)

    assert checked["event_time"].to_list() == ["2026-11-03T09:30:00.000000Z", moment]
    assert checked["reject_reason"].to_list() == [None, "timestamp_unparsable"]


# Any spec: the reference, diabetes (no entity, nine numerics) and tiny (no label) -------------

DIABETES = load_spec("tandem_specs.diabetes:SPEC")
TINY = load_spec("tests.specs.tiny:SPEC")
SPECS = [REFERENCE, DIABETES, TINY]


def _records(ls: LoadedSpec) -> list[dict[str, Any]]:
    """Three of the spec's records (its example, each with an id of its own), with the label."""
    example = ls.spec.example()
    records = [{**example, ls.id.name: f"{example[ls.id.name]}-{row}"} for row in range(3)]
    label = ls.label.name if ls.label else None
    return [{**record, label: row % 2} if label else record for row, record in enumerate(records)]


def _expected(ls: LoadedSpec, records: list[dict[str, Any]]) -> pl.DataFrame:
    frame = raw_frame(ls, records)
    return (
        frame.with_columns(pl.Series(ls.label.name, [r[ls.label.name] for r in records], pl.Int16))
        if ls.label
        else frame
    )


def _sql_source(ls: LoadedSpec, url: str, records: list[dict[str, Any]], numbers: Any = sa.Float) -> SqlSource:
    """The records as a user's table, numerics in columns of type `numbers`, read by `SELECT *`."""
    numerics = {numeric.name for numeric in ls.numerics}
    label = ls.label.name if ls.label else None
    types = {name: numbers if name in numerics else sa.Integer if name == label else sa.String for name in records[0]}
    table = sa.Table("landed", sa.MetaData(), *(sa.Column(name, kind) for name, kind in types.items()))
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        table.create(conn)
        conn.execute(table.insert(), records)
    engine.dispose()
    return SqlSource(ls, url, "SELECT * FROM landed")


@pytest.mark.parametrize("ls", SPECS, ids=lambda ls: ls.spec.name)
def test_every_source_reads_any_specs_records_alike(ls: LoadedSpec, tmp_path: Path) -> None:
    records = _records(ls)
    expected = _expected(ls, records)
    written = pl.DataFrame(records).with_columns(extra=pl.lit("ignored"))
    for fmt in ("csv", "parquet", "ndjson"):
        WRITERS[fmt](written, tmp_path / f"{DAY}.{fmt}")
        read = FileSource(ls, str(tmp_path), "{date:%Y-%m-%d}." + fmt).read(DAY).frame
        assert read.equals(expected), (fmt, read)
    sql = _sql_source(ls, f"sqlite:///{tmp_path / 'source.db'}", records).read(DAY).frame
    assert sql.equals(expected), sql


@pytest.mark.parametrize("ls", SPECS, ids=lambda ls: ls.spec.name)
def test_a_numeric_text_that_is_no_number_is_kept_as_received_for_its_row(ls: LoadedSpec, tmp_path: Path) -> None:
    for numeric in ls.numerics:
        records = [{**record, numeric.name: str(record[numeric.name])} for record in _records(ls)]
        records[1][numeric.name] = "12,5"
        _write_csv(tmp_path / numeric.name / f"{DAY}.csv", records)
        sources = {
            "csv": FileSource(ls, str(tmp_path / numeric.name)),
            "sql": _sql_source(ls, f"sqlite:///{tmp_path / numeric.name / 'source.db'}", records, sa.String),
        }
        for kind, source in sources.items():
            checked = validate(ls, source.read(DAY).frame)
            received = [name for name in checked.columns if name.startswith("received_")]
            assert received == [f"received_{numeric.name}"], (kind, received)
            assert checked[f"received_{numeric.name}"].to_list() == [None, "12,5", None], kind
            assert checked["reject_reason"].to_list() == [None, numeric.unparsable_code, None], kind


def test_the_label_column_is_the_specs_own_and_a_spec_without_one_reads_none(tmp_path: Path) -> None:
    written = [{**record, "label_fraud": 1, "progressed": 1} for record in _records(TINY)]
    _write_csv(tmp_path / f"{DAY}.csv", written)
    assert FileSource(TINY, str(tmp_path)).read(DAY).frame.columns == list(TINY.field_names)
    _write_csv(tmp_path / "reference" / f"{DAY}.csv", [{**r, "progressed": 1} for r in _records(REFERENCE)])
    read = FileSource(REFERENCE, str(tmp_path / "reference")).read(DAY).frame
    assert read.columns == [*RAW_COLUMNS, LABEL]


def test_a_typed_column_is_checked_against_the_specs_field(tmp_path: Path) -> None:
    frame = pl.DataFrame(_records(DIABETES)).with_columns(pl.col("bmi").cast(pl.String))
    frame.write_parquet(tmp_path / f"{DAY}.parquet")
    _raises(FileSource(DIABETES, str(tmp_path), "{date:%Y-%m-%d}.parquet"), "'bmi'", "expected a number, found String")


def test_the_diabetes_demo_day_reads_back_through_csv_with_its_poison(tmp_path: Path) -> None:
    settings = DemoSettings(seed=7, start=DAY, days=7, poison_rate=0.2)
    path, written = write_demo_day(DIABETES, tmp_path, DAY, settings)
    assert written and path == tmp_path / f"{DAY}.csv"
    generated = demo_day(DIABETES, DAY, settings)

    back = FileSource(DIABETES, str(tmp_path)).read(DAY).frame

    assert back.equals(generated.drop(POISON_REASON))
    assert validate(DIABETES, back)["reject_reason"].eq_missing(generated[POISON_REASON]).all()


def test_the_demo_of_a_spec_without_one_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="has no demo"):
        write_demo_day(TINY, tmp_path, DAY, DemoSettings())
