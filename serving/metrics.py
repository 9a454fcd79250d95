"""Prometheus metrics of the online path. Under `bentoml serve` values live in shared files and
/metrics sums the workers; in-process a private registry keeps instances apart. The SLO figures are
exported from the settings, and the latency histogram has a bucket exactly at the p99 target.
"""

from __future__ import annotations

import functools
import os
from typing import Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from serving.settings import ServingSettings

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Scores are probabilities: 0.05 steps over [0, 1].
SCORE_BUCKETS: Final = tuple(round(0.05 * step, 2) for step in range(1, 21))

# What became of each item of a /score request; every item lands in exactly one.
ITEM_OUTCOMES: Final = (
    "scored",  # answered with a score, full account history
    "degraded",  # answered with a score computed without account history (database down)
    "rejected",  # answered with a per-item error (input, model or internal), or refused with the request (422)
    "shed",  # refused at admission with the request (503 overloaded)
    "expired",  # the request's deadline passed first (504)
    "failed",  # the scoring process died (503 unavailable)
)
SECONDS_PER_DAY: Final = 86_400
# Why a sampled item got no shadow answer (serving/shadow.py); the champion's answer is never affected.
SHADOW_DROP_REASONS: Final = (
    "overload",  # the champion had requests waiting: shadow work is the first thing dropped
    "queue_full",  # the shadow queue was at its bound
    "stale",  # waited past ShadowLimits.max_age_s for the champion to be idle
    "scoring_failed",  # the challenger's scoring process failed the batch
    "replaced",  # queued for a challenger that was cleared or replaced meanwhile
    "store_error",  # the shadow answers could not be written
)


LabelledMetric = TypeVar("LabelledMetric", Counter, Gauge, Histogram)


class Children(Generic[LabelledMetric]):
    """The children of a metric with one label, each bound once: `labels()` checks and locks on
    every call, several times for every refused request."""

    def __init__(self, metric: LabelledMetric, label: str, *, exported: tuple[str, ...] = ()) -> None:
        """`exported`: values bound (and so exported at 0) from the start."""
        self._metric: LabelledMetric = metric
        self._label = label
        self._bound: dict[str, LabelledMetric] = {value: metric.labels(**{label: value}) for value in exported}

    def __getitem__(self, value: str) -> LabelledMetric:
        child = self._bound.get(value)
        if child is None:
            child = self._bound[value] = self._metric.labels(**{self._label: value})
        return child


def target_seconds(p99_target_ms: float) -> float:
    """The p99 target in seconds as the histogram bucket and `le` label use it (µs precision, so
    33.3 ms is `le="0.0333"`, not a float artefact)."""
    return round(p99_target_ms / 1000, 6)


def latency_buckets(p99_target_ms: float) -> tuple[float, ...]:
    """The standard latency buckets plus one exactly at the p99 target."""
    return tuple(sorted({*_LATENCY_BUCKETS, target_seconds(p99_target_ms)}))


class ServingMetrics:
    def __init__(
        self,
        code_version: str = "unknown",
        settings: ServingSettings | None = None,
        vocabulary_fields: tuple[str, ...] = (),
    ) -> None:
        """`settings` unset: the defaults of ServingSettings (not the environment), as in tests.
        `vocabulary_fields`: the spec's categorical fields, whose unseen-value counts are exported
        at 0 from the start (others appear with their first count)."""
        resolved = settings if settings is not None else ServingSettings.model_construct()
        self.code_version = code_version
        self.target_s = target_seconds(resolved.p99_target_ms)
        self._serving: str | None = None
        self.registry = CollectorRegistry()
        # Every metric goes to this instance's registry (tests build several side by side).
        self._counter = functools.partial(Counter, registry=self.registry)
        self._gauge = functools.partial(Gauge, registry=self.registry)
        self._histogram = functools.partial(Histogram, registry=self.registry)
        self._define_request_metrics(latency_buckets(resolved.p99_target_ms))
        self._define_batch_metrics(latency_buckets(resolved.p99_target_ms), vocabulary_fields)
        self._define_model_metrics()
        self._shadowing: str | None = None
        self.p99_target.set(self.target_s)
        self.availability_target.set(resolved.availability_target)
        self.slo_window.set(resolved.slo_window_days * SECONDS_PER_DAY)

    def _define_request_metrics(self, buckets: tuple[float, ...]) -> None:
        self.latency = self._histogram(
            "tandem_serving_request_latency_seconds",
            "End-to-end latency of /score, by HTTP status; one bucket is exactly the p99 target.",
            ["status"],
            buckets=buckets,
        )
        self.latency_by_status = Children(self.latency, "status")
        self.p99_target = self._gauge(
            "tandem_serving_p99_target_seconds",
            "The declared p99 latency target.",
            multiprocess_mode="max",
        )
        self.availability_target = self._gauge(
            "tandem_serving_availability_target",
            "The declared availability objective of /score, a ratio (0.999: at most 0.1% of requests answered 5xx).",
            multiprocess_mode="max",
        )
        self.slo_window = self._gauge(
            "tandem_serving_slo_window_seconds",
            "The rolling window the SLOs are declared over.",
            multiprocess_mode="max",
        )
        self.over_target = self._counter(
            "tandem_serving_requests_over_target_total",
            "Successful (200) /score requests whose end-to-end latency exceeded the p99 target.",
        )
        self.items = self._counter(
            "tandem_serving_items_total",
            "Items (transactions) of /score requests, by what became of them.",
            ["outcome"],
        )
        # Exported at 0 from the start, so ratios and increase() see the first one.
        self.items_by_outcome = Children(self.items, "outcome", exported=ITEM_OUTCOMES)
        self.in_flight = self._gauge(
            "tandem_serving_requests_in_flight",
            "/score requests being handled (parsed, queued or being scored).",
            multiprocess_mode="livesum",
        )
        self.scores = self._histogram(
            "tandem_serving_score",
            "Scores returned by /score (degraded ones included).",
            buckets=SCORE_BUCKETS,
        )

    def _define_batch_metrics(self, buckets: tuple[float, ...], vocabulary_fields: tuple[str, ...]) -> None:
        self.queue_depth = self._gauge(
            "tandem_serving_queue_depth", "Items waiting for a batch.", multiprocess_mode="livesum"
        )
        self.queue_wait = self._histogram(
            "tandem_serving_queue_wait_seconds",
            "Time an item waited before its batch started.",
            buckets=buckets,
        )
        self.shed = self._counter("tandem_serving_shed_total", "Requests refused at admission.", ["reason"])
        self.shed_by_reason = Children(self.shed, "reason")
        self.concurrency_limit = self._gauge(
            "tandem_serving_concurrency_limit",
            "The AIMD limit on admitted /score requests in flight (admission.AimdLimit).",
            multiprocess_mode="livesum",
        )
        self.batch_size = self._histogram(
            "tandem_serving_batch_size", "Items per adaptive batch.", buckets=_BATCH_BUCKETS
        )
        self.batch_seconds = self._histogram(
            "tandem_serving_batch_seconds", "Service time of one batch.", buckets=_LATENCY_BUCKETS
        )
        self.item_errors = self._counter(
            "tandem_serving_item_errors_total", "Items answered with an error, by reason.", ["reason"]
        )
        self.cpu_per_request = self._histogram(
            "tandem_serving_request_cpu_seconds",
            "CPU time spent on one request: its parsing plus its share of its batches.",
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1),
        )
        self.outbox_depth = self._gauge(
            "tandem_serving_outbox_depth",
            "Prediction rows waiting in the local outbox.",
            multiprocess_mode="max",
        )
        self.breaker_state = self._gauge(
            "tandem_serving_db_breaker_state",
            "Database circuit breaker: 0 closed, 1 half-open, 2 open.",
            multiprocess_mode="max",
        )
        self.degraded = self._counter(
            "tandem_serving_degraded_total", "Items scored without account history (database down)."
        )
        unseen_values = self._counter(
            "tandem_unseen_values_total",
            "Scored items whose field held a value outside the training vocabulary (scored through the "
            "model's unknown bucket), by field: vocabulary drift, a reason to retrain.",
            ["field"],
        )
        # Children exported at 0 from the start, so rate() and increase() see the first one.
        self.unseen_values = Children(unseen_values, "field", exported=tuple(sorted(vocabulary_fields)))

    def _define_model_metrics(self) -> None:
        self.model_info = self._gauge(
            "tandem_serving_model_info",
            "1 for the model version being served, 0 for versions served earlier by this process.",
            ["model_version", "code_version"],
            multiprocess_mode="livemax",
        )
        model_swaps = self._counter(
            "tandem_serving_model_swaps_total",
            "Attempts to serve a newly promoted (or rolled back) model version without a restart, by outcome.",
            ["outcome"],
        )
        self.model_swaps = Children(model_swaps, "outcome", exported=("succeeded", "failed"))
        shadow_items = self._counter(
            "tandem_shadow_items_total",
            "Sampled items for the challenger's shadow scoring, by outcome (scored, dropped).",
            ["outcome"],
        )
        self.shadow_items = Children(shadow_items, "outcome", exported=("scored", "dropped"))
        shadow_dropped = self._counter(
            "tandem_shadow_dropped_total",
            "Sampled items the challenger did not score, by reason; never counted against the p99 target.",
            ["reason"],
        )
        self.shadow_dropped = Children(shadow_dropped, "reason", exported=SHADOW_DROP_REASONS)
        self.shadow_queue_depth = self._gauge(
            "tandem_shadow_queue_depth", "Items waiting for the challenger.", multiprocess_mode="livesum"
        )
        self.shadow_latency = self._histogram(
            "tandem_shadow_latency_seconds",
            "From the champion's answer to the challenger's shadow answer.",
            buckets=_LATENCY_BUCKETS,
        )
        self.shadow_model_info = self._gauge(
            "tandem_shadow_model_info",
            "1 for the challenger version being shadowed, 0 for versions shadowed earlier by this process.",
            ["model_version"],
            multiprocess_mode="livemax",
        )

    def serving_model(self, model_version: str) -> None:
        """Mark `model_version` as the one answering requests; the earlier one is set to 0, since in
        multiprocess mode a removed child lingers with its last value."""
        if self._serving is not None and self._serving != model_version:
            self.model_info.labels(model_version=self._serving, code_version=self.code_version).set(0)
        self.model_info.labels(model_version=model_version, code_version=self.code_version).set(1)
        self._serving = model_version

    def shadowing_model(self, model_version: str | None) -> None:
        """Mark `model_version` as the challenger being shadowed (None: no shadowing)."""
        if self._shadowing is not None and self._shadowing != model_version:
            self.shadow_model_info.labels(model_version=self._shadowing).set(0)
        if model_version is not None:
            self.shadow_model_info.labels(model_version=model_version).set(1)
        self._shadowing = model_version

    def exposition(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
