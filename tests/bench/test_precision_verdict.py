"""The fp32 / bf16 comparison (bench/precision.py): issue 49's bar for "bf16 pays on the batch
path", the end-to-end estimate from the forward pass's share, the score differences and decision
flips, the CPU flags, and the report's section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.precision import (
    DOES_NOT_PAY,
    FORWARD_SIZES,
    NOT_MEASURABLE,
    PAYS,
    best_size,
    cpu_flags,
    estimated_end_to_end,
    forward_in,
    judge,
    score_differences,
    spread,
    verdicts,
)
from bench.report import precision_section


def test_bf16_pays_only_when_every_bar_is_met_the_bars_included() -> None:
    assert judge(1.5, 0.6, "test")["verdict"] == PAYS
    assert judge(2.4, 0.41, "test", 1.2)["verdict"] == PAYS
    assert judge(1.49, 0.5, "test")["verdict"] == DOES_NOT_PAY
    assert judge(1.8, 0.61, "test")["verdict"] == DOES_NOT_PAY
    assert judge(1.8, 0.5, "test", 1.21)["verdict"] == DOES_NOT_PAY  # memory not flat
    measured = judge(1.25, 0.8, "end to end", 1.5)["measured"]
    assert measured == "rows/s 1.25x, CPU per record 0.80x, peak RSS 1.50x (end to end)"
    assert judge(1.25, 0.8, "estimate")["measured"] == "rows/s 1.25x, CPU per record 0.80x (estimate)"


def test_without_a_measurement_the_verdict_is_not_measurable_never_pays() -> None:
    assert judge(None, 0.5, "end-to-end run")["verdict"] == NOT_MEASURABLE
    assert judge(2.0, None, "end-to-end run")["verdict"] == NOT_MEASURABLE


def test_the_estimate_scales_only_the_forward_share() -> None:
    assert estimated_end_to_end(1.0) == {"cpu_per_record_ratio": 1.0, "rows_per_second_ratio": 1.0}
    half = estimated_end_to_end(2.0, 0.8)
    assert half["cpu_per_record_ratio"] == pytest.approx(0.6)
    assert half["rows_per_second_ratio"] == pytest.approx(1 / 0.6)
    # However fast the forward pass gets, the rest of the batch path stays.
    assert estimated_end_to_end(1e9, 0.79)["cpu_per_record_ratio"] == pytest.approx(0.21)
    with pytest.raises(ValueError, match="forward_ratio > 0"):
        estimated_end_to_end(0.0)
    with pytest.raises(ValueError, match="forward_share <= 1"):
        estimated_end_to_end(2.0, 1.5)


def test_differences_and_flips_at_the_threshold_count_ge_as_risky() -> None:
    fp32 = np.array([0.1, 0.49999, 0.5, 0.7, 0.9])
    bf16 = np.array([0.1001, 0.5, 0.49999, 0.7, 0.9])
    result = score_differences(fp32, bf16, 0.5)
    assert result["items"] == 5
    assert result["flips"] == 2
    assert result["flip_share"] == pytest.approx(0.4)
    assert result["max_abs"] == pytest.approx(1e-4)
    assert result["p99_abs"] == pytest.approx(1e-4)
    assert score_differences(fp32, fp32, 0.5)["max_abs"] == 0.0


def test_differences_refuse_arrays_of_other_shapes_and_report_nothing_for_none() -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        score_differences(np.zeros(3), np.zeros(4), 0.5)
    empty = score_differences(np.array([]), np.array([]), 0.5)
    assert empty["items"] == 0
    assert empty["max_abs"] is None


def test_cpu_flags_read_the_flags_line_as_whole_words() -> None:
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\nbugs\t: amx_bf16\n"
    flags = cpu_flags(text)
    assert flags["avx512_bf16"] and flags["amx_tile"] and flags["avx2"]
    assert not flags["amx_bf16"]  # on another line
    assert not any(cpu_flags("").values())


def test_spread_and_best_size() -> None:
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert spread([])["median"] is None
    assert best_size({"128": 10.0, "1024": 30.0, "256": None}) == "1024"
    with pytest.raises(ValueError, match="no measured size"):
        best_size({"1": None})


def _rate(median: float) -> dict[str, Any]:
    return {"items_per_second": spread([median]), "cpu_ms_per_item": spread([1000 / median])}


def _result(e2e: dict[str, Any] | None) -> dict[str, Any]:
    sweep = {
        "fp32": {str(s): _rate(10_000.0) for s in FORWARD_SIZES},
        "bf16": {str(s): _rate(20_000.0 if s >= 128 else 5_000.0) for s in FORWARD_SIZES},
    }
    stage = {"chunk_rows": 8192, "forward_batch": 128, "fp32": _rate(9_000.0), "bf16": _rate(13_500.0)}
    return {"forward": sweep, "model_stage": stage, "end_to_end": e2e, **verdicts(sweep, stage, e2e, 128)}


def _e2e(fp32: tuple[float, float], bf16: dict[str, tuple[float, ...]]) -> dict[str, Any]:
    """(rows/s, CPU ms per record[, peak RSS MB]) of each variant; fp32's RSS is 500 MB."""
    named = {"fp32": fp32, **bf16}
    return {
        "partition_rows": 20_000,
        "variants": {name: {} for name in named},
        "rows_per_second": {name: spread([v[0]]) for name, v in named.items()},
        "cpu_ms_per_record": {name: spread([v[1]]) for name, v in named.items()},
        "peak_rss_mb": {name: spread([v[2] if len(v) > 2 else 500.0]) for name, v in named.items()},
        "stored_scores": score_differences(np.array([0.2, 0.6]), np.array([0.2001, 0.5999]), 0.5),
    }


def test_without_end_to_end_runs_the_verdict_is_the_forward_estimate() -> None:
    result = _result(None)
    assert result["estimate"]["forward_ratio"] == pytest.approx(2.0)
    assert result["estimate"]["model_stage_ratio"] == pytest.approx(1.5)
    # 0.21 + 0.79 / 2 = 0.605: just past the 0.6 bar.
    assert result["verdict"]["verdict"] == DOES_NOT_PAY
    assert "estimate" in result["verdict"]["source"]


def test_end_to_end_runs_decide_with_a_variant_that_pays_else_the_cheapest() -> None:
    e2e = _e2e((15_000.0, 0.080), {"bf16@128": (18_000.0, 0.070), "bf16@1024": (24_000.0, 0.046)})
    result = _result(e2e)
    assert result["end_to_end_best_bf16"] == "bf16@1024"
    assert result["verdict"]["verdict"] == PAYS
    assert result["verdict"]["rows_per_second_ratio"] == pytest.approx(1.6)
    assert result["verdict_by_variant"]["bf16@128"]["verdict"] == DOES_NOT_PAY
    # The cheapest variant's memory is not flat; a dearer one that meets every bar decides.
    mixed = _result(
        _e2e((15_000.0, 0.080), {"bf16@128": (24_000.0, 0.047, 550.0), "bf16@1024": (25_000.0, 0.040, 900.0)})
    )
    assert mixed["end_to_end_best_bf16"] == "bf16@128"
    assert mixed["verdict"]["verdict"] == PAYS
    slow = _result(_e2e((15_000.0, 0.080), {"bf16@128": (18_000.0, 0.066)}))
    assert slow["verdict"]["verdict"] == DOES_NOT_PAY
    assert slow["end_to_end_best_bf16"] == "bf16@128"


def test_the_report_section_shows_every_size_the_estimate_and_the_verdict() -> None:
    differences = {str(s): score_differences(np.array([0.3, 0.6]), np.array([0.3002, 0.6]), 0.5) for s in FORWARD_SIZES}
    result = {
        **_result(_e2e((15_000.0, 0.080), {"bf16@128": (18_000.0, 0.070)})),
        "hardware": {
            "cpu_model": "Test CPU",
            "cpu_count": 2,
            "cpuinfo_flags": {"amx_bf16": False, "avx512_bf16": True},
            "torch_capabilities": {"amx_bf16": False, "avx512_bf16": True},
            "torch_version": "2.13.0",
            "onednn_version": "3.12.0",
            "mkldnn_available": True,
            "mkldnn_enabled": True,
            "onednn_bf16": {"isa": "AVX-512 bf16", "matmul_kernel": "brg_matmul:avx512_core_bf16", "uses_amx": False},
        },
        "loadavg_1m": {"start": 1.52, "end": 3.0},
        "torch_threads": 1,
        "threads_note": "2 // 2",
        "model": {"train_rows": 3960, "auc": 0.96},
        "scored_day": {"date": "2026-11-04", "items": 2},
        "decision_threshold": 0.5,
        "rounds": 1,
        "seconds_per_reading": 0.3,
        "differences": differences,
    }
    text = "\n".join(precision_section(result))
    assert "AMX bf16 no, AVX-512 BF16 yes" in text
    assert "load average at the phase's start / end: 1.5 / 3.0 (2 CPUs" in text
    for size in FORWARD_SIZES:
        assert f"\n| {size} | " in text
    assert "0 of 2 (0.000%)" in text
    assert "**An estimate**" in text
    assert "of fp32: does not pay.**" in text
    assert "- bf16@128: rows/s 1.20x, CPU per record 0.88x, peak RSS 1.00x" in text
    assert "| bf16@128 | 18,000 | 0.070 | 500 |" in text


def test_an_unknown_precision_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16, not 'fp16'"):
        forward_in("fp16", None)  # type: ignore[arg-type]


def test_bf16_scores_close_to_fp32_but_not_equal() -> None:
    import torch

    from inference.features import FeatureBatch
    from tests.shared import reference_model

    torch.manual_seed(0)
    model = reference_model()
    rng = np.random.default_rng(0)
    size = 4
    batch = FeatureBatch(
        [str(i) for i in range(size)],
        (
            rng.integers(0, 5, (size, 5)).astype(np.int64),
            rng.random((size, 8), dtype=np.float32),
            rng.integers(0, 5, (size, 16, 2)).astype(np.int64),
            rng.random((size, 16, 4), dtype=np.float32),
            np.ones((size, 16), dtype=bool),
        ),
        [None] * size,
    )
    fp32, bf16 = forward_in("fp32", model)(batch), forward_in("bf16", model)(batch)
    assert fp32.dtype == bf16.dtype == np.float64
    difference = np.abs(fp32 - bf16)
    assert 0 < difference.max() < 1e-2


def test_the_committed_run_renders_and_its_verdict_follows_from_its_measurements() -> None:
    committed = json.loads((Path(__file__).resolve().parents[2] / "bench/results/precision.json").read_text())
    judged = verdicts(committed["forward"], committed["model_stage"], committed["end_to_end"], 128)
    assert judged["verdict"] == committed["verdict"]
    assert f"of fp32: {committed['verdict']['verdict']}.**" in "\n".join(precision_section(committed))
