"""The Dagster tag names Tandem keeps as plain strings (assets/dagster_tags.py) are still Dagster's:
this test reads Dagster's private constants on purpose, so the upgrade that renames one fails here
and not silently in the asset graph or the alerts."""

from __future__ import annotations

from dagster._core.definitions import data_version
from dagster._core.storage import tags

from assets import dagster_tags


def test_the_data_version_tags_are_dagsters() -> None:
    assert dagster_tags.DATA_VERSION_TAG == data_version.DATA_VERSION_TAG
    assert dagster_tags.DATA_VERSION_IS_USER_PROVIDED_TAG == data_version.DATA_VERSION_IS_USER_PROVIDED_TAG


def test_the_will_retry_tag_is_dagsters() -> None:
    assert dagster_tags.WILL_RETRY_TAG == tags.WILL_RETRY_TAG
