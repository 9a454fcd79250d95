"""Issue 49, "measure first": the reference model in fp32 and in bf16 side by side, in one run.

bf16 is `torch.autocast("cpu", dtype=torch.bfloat16)` around the forward pass; the sigmoid runs
on the logits cast back to fp32. Three measurements, each alternating fp32 and bf16 (ABAB):

- the forward pass at each size of FORWARD_SIZES, on the torch threads one batch-path model worker
  gets (inference/batch.py), over the features of a real demo day: items/s (median of the rounds,
  every round kept) and, on the same day, the largest and p99 |bf16 - fp32| and the share of
  items whose decision flips at DECISION_THRESHOLD, scored by a model trained on the bench's
  history (the bench's production model is untrained, its scores all near one value);
- the model stage as the batch path runs it: `TorchPredictor.complete` on 8,192-row chunks at the
  batch path's forward batch, and from its ratio and the forward pass's share of the batch path's
  CPU per record (FORWARD_SHARE) an estimate of the end-to-end ratios;
- the batch path end to end (`bench.batch_worker --precision`), one partition, each run in its
  own process: rows/s and CPU per record, and the stored scores of both precisions compared.

The verdict is issue 49's bar, judged on the end-to-end runs where they ran, else on the estimate.
"""

from __future__ import annotations

import itertools
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.harness import START_DAY, say

if TYPE_CHECKING:
    from inference.contract import ForwardFn, PreparedBatch, TorchPredictor
    from inference.features import FeatureBatch
    from inference.model import LoadedModel

FORWARD_SIZES = (1, 8, 32, 128, 256, 1024)
PRECISIONS = ("fp32", "bf16")
# Issue 49's bar for "it pays" on the batch path, against fp32 in the same run.
ROWS_PER_S_FACTOR = 1.5
CPU_PER_RECORD_FACTOR = 0.6
# "Memory flat", as the batch path's own target reads it (docs/benchmarks.md: flat, <= 1.2x).
MEMORY_FACTOR = 1.2
# The forward pass's share of the batch path's CPU per record: 0.060 of 0.076 ms (bench/findings.md,
# "Why 80% of the raw forward is out of reach"); the estimate scales only this share.
FORWARD_SHARE = 0.79
CHUNK_ROWS = 8192  # score_partition's default chunk
# The CPU flags that decide what oneDNN can use for bf16 (/proc/cpuinfo's names).
CPU_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512f", "avx512_vnni", "avx2")
MODEL_NAME = "risk_model_precision"
PAYS, DOES_NOT_PAY, NOT_MEASURABLE = "pays", "does not pay", "not measurable"


@dataclass(frozen=True)
class PrecisionPlan:
    """What the phase measures; quick mode the same steps, smaller and shorter."""

    quick: bool
    scored_rows: int  # the real day the forward sweep scores
    seconds: float  # per timed forward reading
    rounds: int  # ABAB rounds of the forward sweep and the model stage
    partition_rows: int  # the end-to-end partition
    e2e_rounds: int

    @classmethod
    def for_mode(cls, quick: bool) -> PrecisionPlan:
        if quick:
            return cls(True, 4_000, 0.3, 2, 20_000, 1)
        return cls(False, 20_000, 1.0, 5, 1_000_000, 2)

    def estimate_s(self, history_rows: int) -> float:
        """Rough seconds, from earlier runs on the 2-core machine (nothing is judged on them)."""
        training = history_rows / 1_000  # two epochs of the bench's history
        sweep = self.rounds * len(PRECISIONS) * (len(FORWARD_SIZES) + 1) * self.seconds
        differences = len(FORWARD_SIZES) * 2 * self.scored_rows / 8_000
        # ingest, then each run: a process start and the partition at about 14,000 rows/s
        e2e = self.partition_rows / 20_000 + self.e2e_rounds * 3 * (8 + self.partition_rows / 14_000)
        return 10 + training + sweep + differences + e2e


# ---------------------------------------------------------------- pure logic (tests/bench)
def cpu_flags(cpuinfo: str) -> dict[str, bool]:
    """Which of CPU_FLAGS the first `flags` line of /proc/cpuinfo's text names."""
    match = re.search(r"^flags\s*:(.*)$", cpuinfo, re.MULTILINE)
    present = set(match.group(1).split()) if match else set()
    return {flag: flag in present for flag in CPU_FLAGS}


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of the rounds, every round kept."""
    if not values:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def score_differences(reference: np.ndarray, other: np.ndarray, threshold: float) -> dict[str, Any]:
    """|other - reference| (largest, p99) and the items on the other side of `threshold`, with
    `>=` meaning risky as in `inference.agreement.summarize`."""
    if reference.shape != other.shape:
        raise ValueError(f"score arrays differ in shape: {reference.shape} and {other.shape}")
    if reference.size == 0:
        return {"items": 0, "max_abs": None, "p99_abs": None, "flips": 0, "flip_share": None}
    difference = np.abs(other - reference)
    flips = int(np.count_nonzero((reference >= threshold) != (other >= threshold)))
    return {
        "items": int(reference.size),
        "max_abs": float(difference.max()),
        "p99_abs": float(np.quantile(difference, 0.99, method="nearest")),
        "flips": flips,
        "flip_share": flips / reference.size,
    }


def estimated_end_to_end(forward_ratio: float, forward_share: float = FORWARD_SHARE) -> dict[str, float]:
    """CPU per record and rows/s of the batch path against fp32 when only the forward pass,
    `forward_share` of its CPU per record, runs `forward_ratio` times as many items per second.
    Rows/s is the inverse of CPU per record: it assumes the batch path stays CPU-bound."""
    if forward_ratio <= 0 or not 0 <= forward_share <= 1:
        raise ValueError(f"need forward_ratio > 0 and 0 <= forward_share <= 1, not {forward_ratio}, {forward_share}")
    cpu = (1 - forward_share) + forward_share / forward_ratio
    return {"cpu_per_record_ratio": cpu, "rows_per_second_ratio": 1 / cpu}


def judge(
    rows_ratio: float | None, cpu_ratio: float | None, source: str, memory_ratio: float | None = None
) -> dict[str, Any]:
    """Issue 49's bar: bf16 pays for the batch path only if rows/s is at least ROWS_PER_S_FACTOR
    times fp32's and CPU per record at most CPU_PER_RECORD_FACTOR times, both in the same run,
    with memory flat (peak RSS at most MEMORY_FACTOR times) where it was measured."""
    target = (
        f"bf16 on the batch path: rows/s >= {ROWS_PER_S_FACTOR:g}x, CPU per record "
        f"<= {CPU_PER_RECORD_FACTOR:g}x and peak RSS <= {MEMORY_FACTOR:g}x of fp32"
    )
    if rows_ratio is None or cpu_ratio is None:
        return {"target": target, "measured": f"no {source}", "verdict": NOT_MEASURABLE, "source": source}
    pays = rows_ratio >= ROWS_PER_S_FACTOR and cpu_ratio <= CPU_PER_RECORD_FACTOR
    memory = ""
    if memory_ratio is not None:
        pays = pays and memory_ratio <= MEMORY_FACTOR
        memory = f", peak RSS {memory_ratio:.2f}x"
    return {
        "target": target,
        "measured": f"rows/s {rows_ratio:.2f}x, CPU per record {cpu_ratio:.2f}x{memory} ({source})",
        "verdict": PAYS if pays else DOES_NOT_PAY,
        "rows_per_second_ratio": rows_ratio,
        "cpu_per_record_ratio": cpu_ratio,
        "peak_rss_ratio": memory_ratio,
        "source": source,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def best_size(rates: Mapping[str, float | None]) -> str:
    """The size with the most items/s (the first of equals)."""
    known = {size: rate for size, rate in rates.items() if rate is not None}
    if not known:
        raise ValueError("no measured size")
    return max(known, key=lambda size: known[size])


# ---------------------------------------------------------------- the machine
def hardware() -> dict[str, Any]:
    """The CPU's bf16 flags and torch's view of them, through public APIs only."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    capabilities = torch.cpu.get_capabilities()
    onednn = re.search(r"MKL-DNN v([0-9.]+)", torch.__config__.show())
    return {
        "cpu_model": model.group(1) if model else "unknown",
        "cpu_count": os.cpu_count(),
        "cpuinfo_flags": cpu_flags(text),
        "torch_version": torch.__version__,
        "torch_capabilities": {
            name: bool(capabilities.get(name, False)) for name in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_f")
        },
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "onednn_version": onednn.group(1) if onednn else None,
        "onednn_bf16": onednn_bf16_kernels(),
    }


_ONEDNN_PROBE = """
import torch
from torch import nn
layer = nn.Linear(256, 256)
with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
    layer(torch.ones(64, 256))
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        layer(torch.ones(64, 256))
"""


def onednn_bf16_kernels() -> dict[str, Any]:
    """oneDNN's own word on what a bf16 Linear runs on: its ISA line and the matmul kernel, from
    `torch.backends.mkldnn.verbose` in a child process (oneDNN prints from C to stdout)."""
    done = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], capture_output=True, text=True, check=False)
    isa = re.search(r"onednn_verbose,.*isa:(.*)$", done.stdout, re.MULTILINE)
    kernel = re.search(r"onednn_verbose,.*exec,cpu,matmul,([^,]+),", done.stdout)
    return {
        "isa": isa.group(1).strip() if isa else None,
        "matmul_kernel": kernel.group(1) if kernel else None,
        "uses_amx": bool(kernel and "amx" in kernel.group(1)),
    }


# ---------------------------------------------------------------- forward passes
def forward_in(precision: str, model: LoadedModel) -> ForwardFn:
    """A `TorchPredictor.forward` that scores in `precision`: fp32 is `score_batch` itself."""
    import torch

    from inference.model import score_batch

    if precision == "fp32":
        return lambda features: score_batch(model, features)
    if precision != "bf16":
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")

    def bf16(features: FeatureBatch) -> np.ndarray:
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model.module(*features.tensors())
            return torch.sigmoid(logits.float()).double().numpy()

    return bf16


def _timed(work: Callable[[], int], seconds: float) -> dict[str, float]:
    """Items/s (wall) and CPU ms per item of `work` (which returns items done), run for `seconds`."""
    work()  # warm: oneDNN builds its kernels on first use
    done, wall, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        done += work()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"items_per_second": done / wall, "cpu_ms_per_item": cpu * 1000 / done}


def _tiled(features: FeatureBatch, rows: int) -> FeatureBatch:
    """`rows` items of `features`, repeated from the start as needed (the day may be smaller)."""
    return features.take(np.arange(rows) % len(features))


def _cycling(forward: ForwardFn, parts: list[FeatureBatch]) -> Callable[[], int]:
    """One forward over the next of `parts` per call, round and round; returns the items scored."""
    turn = itertools.count()

    def one() -> int:
        part = parts[next(turn) % len(parts)]
        forward(part)
        return len(part)

    return one


def forward_sweep(model: LoadedModel, day: FeatureBatch, plan: PrecisionPlan) -> dict[str, Any]:
    """Items/s of each precision at each size, ABAB over `plan.rounds` rounds, on the day's items."""
    forwards = {precision: forward_in(precision, model) for precision in PRECISIONS}
    readings: dict[str, dict[str, list[dict[str, float]]]] = {
        p: {str(s): [] for s in FORWARD_SIZES} for p in PRECISIONS
    }
    pools = {size: _tiled(day, max(size, len(day))) for size in FORWARD_SIZES}
    parts = {
        size: [pool.slice(start, start + size) for start in range(0, len(pool) - size + 1, size)]
        for size, pool in pools.items()
    }
    # A first round, not kept: cold caches and oneDNN building a kernel per shape would otherwise
    # be charged to the first round's readings.
    for size in FORWARD_SIZES:
        for precision in PRECISIONS:
            _timed(_cycling(forwards[precision], parts[size]), plan.seconds / 4)
    for _ in range(plan.rounds):
        for size in FORWARD_SIZES:
            for precision in PRECISIONS:
                readings[precision][str(size)].append(_timed(_cycling(forwards[precision], parts[size]), plan.seconds))
    return {precision: _summary(by_size) for precision, by_size in readings.items()}


def _summary(readings: Mapping[str, list[dict[str, float]]]) -> dict[str, Any]:
    return {
        key: {
            "items_per_second": spread([r["items_per_second"] for r in runs]),
            "cpu_ms_per_item": spread([r["cpu_ms_per_item"] for r in runs]),
        }
        for key, runs in readings.items()
    }


def day_differences(model: LoadedModel, day: FeatureBatch, threshold: float) -> dict[str, Any]:
    """bf16 against fp32 on the day's items at each size: small sizes on a prefix (2,000 items per
    item of batch), so batch 1 does not score the whole day twice."""
    forwards = {precision: forward_in(precision, model) for precision in PRECISIONS}
    result = {}
    for size in FORWARD_SIZES:
        items = min(len(day), 2_000 * size)
        scores = {
            precision: np.concatenate(
                [forward(day.slice(start, min(start + size, items))) for start in range(0, items, size)]
            )
            for precision, forward in forwards.items()
        }
        result[str(size)] = score_differences(scores["fp32"], scores["bf16"], threshold)
    return result


def model_stage(model: LoadedModel, day: FeatureBatch, plan: PrecisionPlan, forward_batch: int) -> dict[str, Any]:
    """`TorchPredictor.complete` on CHUNK_ROWS-row chunks at the batch path's forward batch: the
    model stage's work per chunk (forward passes, isolation, the result frame), ABAB."""
    import polars as pl

    from inference.contract import PreparedBatch, TorchPredictor

    chunk = _tiled(day, CHUNK_ROWS)
    ids = pl.Series("record_id", [f"t{i}" for i in range(CHUNK_ROWS)])
    prepared = PreparedBatch(
        record_ids=ids,
        input_hashes=pl.Series("input_hash", [f"h{i}" for i in range(CHUNK_ROWS)]),
        reasons=[None] * CHUNK_ROWS,
        details=[None] * CHUNK_ROWS,
        history_hashes=["g"] * CHUNK_ROWS,
        unseen=[None] * CHUNK_ROWS,
        valid_positions=np.arange(CHUNK_ROWS),
        features=chunk,
    )
    from inference.spec import configured_spec

    spec = configured_spec()
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PRECISIONS}
    for _ in range(plan.rounds):
        for precision in PRECISIONS:
            predictor = TorchPredictor(
                model=model,
                model_version="bench:precision",
                spec=spec,
                forward_batch_size=forward_batch,
                forward=forward_in(precision, model),
            )
            runs[precision].append(_timed(partial(_complete, predictor, prepared), max(plan.seconds, 2.0)))
    return {"chunk_rows": CHUNK_ROWS, "forward_batch": forward_batch, **_summary(runs)}


def _complete(predictor: TorchPredictor, prepared: PreparedBatch) -> int:
    return predictor.complete(prepared).height


# ---------------------------------------------------------------- the environment's pieces
def train_model(database_url: str, history_days: int) -> tuple[LoadedModel, dict[str, Any]]:
    """The reference model trained on the bench's history (the last day held out), registered and
    promoted as MODEL_NAME for the end-to-end workers."""
    from inference.spec import configured_spec
    from inference.store import make_engine
    from inference.training import train_from_store
    from tandem import modelstore

    engine = make_engine(database_url)
    try:
        spec = configured_spec()
        model, report = train_from_store(
            engine,
            spec,
            first_day=START_DAY,
            holdout_day=START_DAY + timedelta(days=history_days - 1),
            config=spec.spec.model_config(spec.spec.history_length),
            seed=0,
        )
    finally:
        engine.dispose()
    modelstore.promote(modelstore.register(model, report, name=MODEL_NAME, code_version="bench"))
    return model, {"auc": report.auc, "train_rows": report.train_rows, "holdout_rows": report.holdout_rows}


def scored_day(database_url: str, day: date, rows: int, history_length: int) -> FeatureBatch:
    """A demo day ingested and featurised after the stored history, as a partition is scored:
    each row's history is its entity's earlier valid rows."""
    from inference.batch import ingest_day
    from inference.demo import demo_day
    from inference.features import build_features
    from inference.spec import DemoSettings, configured_spec
    from inference.store import make_engine, valid_rows_between

    spec = configured_spec()
    engine = make_engine(database_url)
    try:
        ingest_day(spec, engine, demo_day(spec, day, DemoSettings(rows_per_day=rows, poison_rate=0.01)), day)
        with engine.connect() as conn:
            rows_frame = valid_rows_between(spec, conn, START_DAY, day + timedelta(days=1))
    finally:
        engine.dispose()
    entity = [spec.entity.name] if spec.entity else []
    rows_frame = rows_frame.sort([*entity, "event_ts", spec.id.name])
    features = build_features(spec, rows_frame, rows_frame, history_length)
    return features.take(np.flatnonzero((rows_frame["partition_date"] == day).to_numpy()))


def stored_scores(database_url: str, day: date) -> dict[str, float]:
    """The batch scores a partition holds, by record."""
    import sqlalchemy as sa

    from inference.store import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT record_id, score FROM predictions WHERE partition_key = :key AND path = 'batch'"),
                {"key": day.isoformat()},
            ).all()
    finally:
        engine.dispose()
    return {str(t): float(s) for t, s in rows}


def compare_stored(first: Mapping[str, float], second: Mapping[str, float], threshold: float) -> dict[str, Any]:
    """Two runs' stored scores of the same partition, over the records both scored."""
    common = sorted(first.keys() & second.keys())
    a = np.array([first[t] for t in common], dtype=np.float64)
    b = np.array([second[t] for t in common], dtype=np.float64)
    return score_differences(a, b, threshold)


# ---------------------------------------------------------------- the phase
Score = Callable[..., dict[str, Any]]


def end_to_end(
    database_url: str, day: date, score: Score, forward_batch: int, bf16_batch: int, rounds: int, threshold: float
) -> dict[str, Any]:
    """The partition scored by the batch worker: fp32 at the batch path's forward batch, bf16 at
    the same and (if another) at bf16's best forward size, ABAB; the first fp32 and bf16 runs'
    stored scores compared. `score(day, *options)` runs one worker on a cleared partition."""
    variants = {"fp32": ("fp32", forward_batch), f"bf16@{forward_batch}": ("bf16", forward_batch)}
    if bf16_batch != forward_batch:
        variants[f"bf16@{bf16_batch}"] = ("bf16", bf16_batch)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    stored: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for name, (precision, batch) in variants.items():
            result = score(day, "--precision", precision, "--forward-batch", str(batch), "--model-name", MODEL_NAME)
            say(f"precision end to end, {name}: {result}")
            runs[name].append(result)
            if precision not in stored:
                stored[precision] = stored_scores(database_url, day)
    return {
        "forward_batch": forward_batch,
        "variants": {name: {"precision": p, "forward_batch": b} for name, (p, b) in variants.items()},
        "runs": runs,
        "rows_per_second": {name: spread([r["rows_per_second"] for r in by]) for name, by in runs.items()},
        "cpu_ms_per_record": {name: spread([r["cpu_ms_per_record"] for r in by]) for name, by in runs.items()},
        "peak_rss_mb": {name: spread([r["peak_rss_mb"] for r in by]) for name, by in runs.items()},
        "stored_scores": compare_stored(stored["fp32"], stored["bf16"], threshold),
    }


def verdicts(
    sweep: dict[str, Any], stage: dict[str, Any], e2e: dict[str, Any] | None, forward_batch: int
) -> dict[str, Any]:
    """The estimates from the forward pass's and the model stage's ratios, and the verdict: on the
    end-to-end runs where they ran (each bf16 variant judged; the verdict is one that pays, else
    the one with the least CPU per record), else on the forward pass's estimate."""

    def median(entry: dict[str, Any]) -> float | None:
        value = entry["items_per_second"]["median"]
        return float(value) if value is not None else None

    forward_ratio = ratio(median(sweep["bf16"][str(forward_batch)]), median(sweep["fp32"][str(forward_batch)]))
    stage_ratio = ratio(median(stage["bf16"]), median(stage["fp32"]))
    estimates: dict[str, Any] = {
        "forward_ratio": forward_ratio,
        "model_stage_ratio": stage_ratio,
        "forward_share": FORWARD_SHARE,
        "from_forward": estimated_end_to_end(forward_ratio) if forward_ratio else None,
        "from_model_stage": estimated_end_to_end(stage_ratio) if stage_ratio else None,
    }
    result: dict[str, Any] = {"estimate": estimates}
    if forward_ratio:
        est = estimates["from_forward"]
        result["estimated_verdict"] = judge(
            est["rows_per_second_ratio"],
            est["cpu_per_record_ratio"],
            f"an estimate from the forward pass at batch {forward_batch}",
        )
    if e2e is None:
        result["verdict"] = result.get("estimated_verdict") or judge(None, None, "measurement")
        return result
    cpu, rows, rss = e2e["cpu_ms_per_record"], e2e["rows_per_second"], e2e["peak_rss_mb"]
    by_variant = {
        name: judge(
            ratio(rows[name]["median"], rows["fp32"]["median"]),
            ratio(cpu[name]["median"], cpu["fp32"]["median"]),
            f"end to end, {name} against fp32@{forward_batch}, medians",
            ratio(rss[name]["median"], rss["fp32"]["median"]),
        )
        for name in cpu
        if name != "fp32"
    }
    result["verdict_by_variant"] = by_variant
    measured = {name: v for name, v in by_variant.items() if v["verdict"] != NOT_MEASURABLE}
    if not measured:
        result["end_to_end_best_bf16"] = None
        result["verdict"] = judge(None, None, "end-to-end run")
        return result
    # The variant that pays if one does, else the one with the least CPU per record.
    best = min(measured, key=lambda name: (measured[name]["verdict"] != PAYS, measured[name]["cpu_per_record_ratio"]))
    result["end_to_end_best_bf16"] = best
    result["verdict"] = measured[best]
    return result


def bench_precision(
    database_url: str, plan: PrecisionPlan, history_days: int, history_rows: int, score: Score | None
) -> dict[str, Any]:
    """The whole phase; `score` runs the batch worker on a cleared partition (None: no end-to-end)."""
    import torch

    from inference.agreement import DECISION_THRESHOLD
    from inference.batch import FORWARD_BATCH_SIZE, MODEL_WORKERS

    load_before = os.getloadavg()[0]
    machine = hardware()
    say(f"precision: {machine}")
    model, training = train_model(database_url, history_days)
    say(f"precision: trained on {training}")
    day = START_DAY + timedelta(days=history_days)
    features = scored_day(database_url, day, plan.scored_rows, model.history_length)
    threads_before = torch.get_num_threads()
    # As score_partition sets it for each of its MODEL_WORKERS model workers.
    threads = max(1, threads_before // MODEL_WORKERS)
    torch.set_num_threads(threads)
    try:
        sweep = forward_sweep(model, features, plan)
        say(
            "precision forward items/s (median): "
            + "; ".join(
                f"{p} " + ", ".join(f"{s}: {v['items_per_second']['median']:,.0f}" for s, v in sweep[p].items())
                for p in PRECISIONS
            )
        )
        differences = day_differences(model, features, DECISION_THRESHOLD)
        say(f"precision differences on {day}: {differences}")
        stage = model_stage(model, features, plan, FORWARD_BATCH_SIZE)
        say(f"precision model stage: {stage}")
    finally:
        torch.set_num_threads(threads_before)
    bf16_best = int(best_size({s: v["items_per_second"]["median"] for s, v in sweep["bf16"].items()}))
    e2e = None
    if score is not None:
        partition = START_DAY + timedelta(days=45)
        from inference.batch import ingest_day
        from inference.demo import demo_day
        from inference.spec import DemoSettings, configured_spec
        from inference.store import make_engine

        engine = make_engine(database_url)
        demo = DemoSettings(rows_per_day=plan.partition_rows, poison_rate=0.01)
        ingest_day(configured_spec(), engine, demo_day(configured_spec(), partition, demo), partition)
        engine.dispose()
        e2e = end_to_end(
            database_url, partition, score, FORWARD_BATCH_SIZE, bf16_best, plan.e2e_rounds, DECISION_THRESHOLD
        )
        e2e["partition_rows"] = plan.partition_rows
    judged = verdicts(sweep, stage, e2e, FORWARD_BATCH_SIZE)
    verdict = judged["verdict"]
    say(f"precision verdict: {verdict['target']}: {verdict['measured']} -> {verdict['verdict']}")
    return {
        "quick": plan.quick,
        "hardware": machine,
        # The machine's 1-minute load average as the phase starts and ends: its cores are shared.
        "loadavg_1m": {"start": load_before, "end": os.getloadavg()[0]},
        "torch_threads": threads,
        "threads_note": f"torch.get_num_threads() {threads_before} // MODEL_WORKERS {MODEL_WORKERS}, "
        "as score_partition sets each model worker",
        "decision_threshold": DECISION_THRESHOLD,
        "model": {"name": MODEL_NAME, "history_rows": history_rows, **training},
        "scored_day": {"date": day.isoformat(), "items": len(features)},
        "sizes": list(FORWARD_SIZES),
        "rounds": plan.rounds,
        "seconds_per_reading": plan.seconds,
        "forward": sweep,
        "differences": differences,
        "model_stage": stage,
        "bf16_best_forward_size": bf16_best,
        "end_to_end": e2e,
        **judged,
    }
