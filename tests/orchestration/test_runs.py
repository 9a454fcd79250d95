"""Which days a run works on, for each way Dagster tags one (orchestration/runs.py)."""

from __future__ import annotations

from dagster import DagsterRun, DailyPartitionsDefinition, StaticPartitionsDefinition

from orchestration.runs import partition_label, run_partitions

DAYS = DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-08", timezone="UTC")


def _run(**tags: str) -> DagsterRun:
    return DagsterRun(job_name="__ASSET_JOB", tags={f"dagster/{name}": value for name, value in tags.items()})


def test_a_sensors_run_names_its_day() -> None:
    run = _run(partition="2026-11-03")
    assert run_partitions(run, DAYS) == {"2026-11-03"}
    assert partition_label(run) == "2026-11-03"


def test_an_asset_backfill_run_of_one_day_names_it_as_a_range() -> None:
    run = _run(asset_partition_range_start="2026-11-03", asset_partition_range_end="2026-11-03")
    assert run_partitions(run, DAYS) == {"2026-11-03"}
    assert partition_label(run) == "2026-11-03"


def test_a_range_covers_every_day_from_its_start_to_its_end() -> None:
    run = _run(asset_partition_range_start="2026-11-02", asset_partition_range_end="2026-11-04")
    assert run_partitions(run, DAYS) == {"2026-11-02", "2026-11-03", "2026-11-04"}
    assert partition_label(run) == "2026-11-02...2026-11-04"


def test_an_unpartitioned_run_or_a_range_of_another_partition_set_covers_no_day() -> None:
    assert run_partitions(_run(), DAYS) == set()
    assert partition_label(_run()) is None
    other = _run(asset_partition_range_start="eu", asset_partition_range_end="us")
    assert run_partitions(other, DAYS) == set()
    assert run_partitions(other, StaticPartitionsDefinition(["eu", "uk", "us"])) == {"eu", "uk", "us"}
