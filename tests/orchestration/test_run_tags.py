"""The run tags Tandem reads and writes as plain strings (assets/dagster_tags.py) for partitions and
run retries are still Dagster's: this test reads Dagster's private constants on purpose, so the
upgrade that renames one fails here, not silently in the partition check or the sensors."""

from __future__ import annotations

from dagster._core.storage import tags

from assets import dagster_tags


def test_the_partition_tags_are_dagsters() -> None:
    assert dagster_tags.PARTITION_TAG == tags.PARTITION_NAME_TAG
    assert dagster_tags.RANGE_START_TAG == tags.ASSET_PARTITION_RANGE_START_TAG
    assert dagster_tags.RANGE_END_TAG == tags.ASSET_PARTITION_RANGE_END_TAG


def test_the_max_retries_tag_is_dagsters() -> None:
    assert dagster_tags.MAX_RETRIES_TAG == tags.MAX_RETRIES_TAG
