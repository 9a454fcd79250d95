"""The core's timeline through a spec of another shape: tests/specs/tiny.py (an entity, K = 2)
and the same spec without history (K = 0, no entity)."""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import types
from collections.abc import Iterator

import numpy as np
import polars as pl
import pytest

from inference.features import NO_HISTORY_DIGEST, build_features
from inference.spec import EntityKey, LoadedSpec, load_spec
from tests.specs import tiny

EVENT_TS = pl.Datetime("us", "UTC")


def readings(*rows: tuple[str, str, float, str, int]) -> pl.DataFrame:
    """(reading_id, sensor_id, level, colour, minute of the day) rows, with event_ts and hashes."""
    frame = pl.DataFrame(
        [
            {
                "reading_id": rid,
                "sensor_id": sensor,
                "level": level,
                "colour": colour,
                "taken_at": f"2026-11-01T08:{minute:02d}:00Z",
                "input_hash": hashlib.sha256(f"{rid}:{level}".encode()).hexdigest()[:32],
            }
            for rid, sensor, level, colour, minute in rows
        ]
    )
    return frame.with_columns(event_ts=pl.col("taken_at").str.to_datetime(time_unit="us", time_zone="UTC"))


DAY = readings(
    ("r1", "s1", 10.0, "red", 1),
    ("r2", "s1", 20.0, "green", 2),
    ("r3", "s2", 30.0, "blue", 3),
    ("r4", "s1", 40.0, "purple", 4),
    ("r5", "s1", 50.0, "red", 5),
)


@pytest.fixture
def flat() -> Iterator[LoadedSpec]:
    """tiny without an entity and at K = 0."""
    module = types.ModuleType("tandem_flat_spec")
    module.SPEC = dataclasses.replace(  # type: ignore[attr-defined]
        tiny.SPEC, history_length=0, fields=tuple(f for f in tiny.SPEC.fields if not isinstance(f, EntityKey))
    )
    sys.modules["tandem_flat_spec"] = module
    yield load_spec("tandem_flat_spec:SPEC")
    del sys.modules["tandem_flat_spec"]
    load_spec.cache_clear()


def test_each_target_reads_its_entitys_k_earlier_records() -> None:
    spec = load_spec("tests.specs.tiny:SPEC")
    features = build_features(spec, DAY, DAY, 2)
    colour, level = features.arrays
    assert features.record_ids == ["r1", "r2", "r3", "r4", "r5"]
    assert colour.tolist() == [0, 1, 2, 3, 0]  # purple is outside the vocabulary: the unknown bucket
    # level/100 minus the mean of the sensor's last two levels/100 (none: minus 0).
    assert np.allclose(level, [0.1, 0.2 - 0.1, 0.3, 0.4 - 0.15, 0.5 - 0.3])
    assert features.unseen == [None, None, None, "colour", None]
    assert features.history_digests is not None and features.history_digests[0] == NO_HISTORY_DIGEST
    assert len(set(features.history_digests)) == 4  # r1 and r3 read nothing


def test_online_one_record_alone_gets_the_partitions_features() -> None:
    spec = load_spec("tests.specs.tiny:SPEC")
    partition = build_features(spec, DAY, DAY, 2)
    for position in range(DAY.height):
        alone = build_features(spec, DAY.slice(position, 1), DAY, 2, targets_read_each_other=False)
        assert alone.history_digests == partition.history_digests[position : position + 1]  # type: ignore[index]
        for a, b in zip(alone.arrays, partition.slice(position, position + 1).arrays, strict=True):
            assert np.array_equal(a, b)


def test_a_corrected_history_record_moves_only_later_digests() -> None:
    spec = load_spec("tests.specs.tiny:SPEC")
    before = build_features(spec, DAY, DAY, 2).history_digests
    corrected = DAY.with_columns(
        input_hash=pl.when(pl.col("reading_id") == "r2").then(pl.lit("f" * 32)).otherwise(pl.col("input_hash"))
    )
    after = build_features(spec, corrected, corrected, 2).history_digests
    assert before is not None and after is not None
    changed = [rid for rid, old, new in zip(DAY["reading_id"], before, after, strict=True) if old != new]
    assert changed == ["r4", "r5"]  # r2's own digest is of what it read; r3 is another sensor


def test_without_history_nothing_is_read_and_every_digest_is_empty(flat: LoadedSpec) -> None:
    unrelated = readings(("x1", "s1", 99.0, "red", 0))
    features = build_features(flat, DAY.drop("sensor_id"), unrelated.drop("sensor_id"), 0)
    level = features.arrays[1]
    assert features.record_ids == ["r1", "r2", "r3", "r4", "r5"]
    assert np.allclose(level, [0.1, 0.2, 0.3, 0.4, 0.5])
    assert features.history_digests == [NO_HISTORY_DIGEST] * 5
    with pytest.raises(ValueError, match=r"history_length 2 outside 0\.\.256, or without an entity"):
        build_features(flat, DAY.drop("sensor_id"), DAY.drop("sensor_id"), 2)
