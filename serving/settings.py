"""Knobs of the online path, resolved when the service starts (never at import time)."""

from __future__ import annotations

import math

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# BentoML's own per-request timeout (`traffic.timeout`) is a backstop behind the requests' deadlines.
# It cannot be switched off (BentoML requires > 0). It is served as serving.middleware_order.Backstop,
# whose timer ends when the response starts; BentoML's own left every request's timer alive this
# long for the server's full garbage collections to walk (30 s: ~230,000 objects at 1,200 rps,
# 10 s: ~90,000; bench/findings.md, 2026-12-03). The floor stays 10 s, and with it the longest
# deadline a request may ask for, 9 s (README).
MIN_BACKSTOP_TIMEOUT_S = 10


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_SERVING_", extra="ignore")

    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Server processes, each with its own event loop, scoring process and model copy. "
        "Read when the service module loads.",
    )
    p99_target_ms: float = Field(default=50.0, gt=0, description="Declared p99 latency target; drives shedding.")
    availability_target: float = Field(
        default=0.999,
        gt=0,
        lt=1,
        description="Declared availability objective of /score (a ratio; docs/slo.md). Exported for alerts.",
    )
    slo_window_days: int = Field(
        default=28, ge=1, le=366, description="Rolling window the SLOs are declared over. Exported for dashboards."
    )
    max_batch_size: int = Field(default=64, ge=1, le=4096, description="Items per adaptive batch at most.")
    burst_interval_ms: float = Field(
        default=250.0,
        ge=0,
        description="How long the queue may stand over the p99 target before its age sheds requests "
        "(CoDel's interval): a burst that drains sooner is served, not shed. 0 sheds at once.",
    )
    queue_capacity: int = Field(
        default=1024, ge=1, description="Hard bound on queued items, whatever the predicted wait says."
    )
    min_concurrency: int = Field(
        default=16,
        ge=1,
        description="The floor of the adaptive limit on admitted requests in flight (admission.ConcurrencyLimit), "
        "which shrinks past capacity when admitted requests miss the target. About capacity x latency at the "
        "target (Little's law): lower floors starved goodput here when contention, not queueing, set latency.",
    )
    max_concurrency: int = Field(
        default=128,
        ge=1,
        description="The adaptive limit's ceiling, where it starts and where an idle service returns to: the most "
        "admitted requests in flight before latency has told it anything. A burst up to it is served whole; at the "
        "step into overload, it is what is admitted before the first correction (with the queue's bound, 1,024, "
        "the first 100 ms of a step to 1,400 rps were answered at p50 78-256 ms here; bench/findings.md).",
    )
    concurrency_headroom: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="The adaptive limit aims to hold each window's estimated p99 (its mean latency times the p99's "
        "learnt ratio to the mean) within this share of the p99 target: the rest is room for what the service does "
        "not see (the socket backlog before it reads a request, the network, the client's own loop).",
    )
    concurrency_burst: int = Field(
        default=64,
        ge=0,
        description="How many requests may be let in beyond the concurrency at which the adaptive limit last "
        "held the target under overload, before the limit drops back there: a burst spends part of it once and "
        "drains, an overload keeps arriving and spends it all within tens of milliseconds. It refills over a "
        "second while fewer are in flight.",
    )
    concurrency_window_ms: float = Field(
        default=100.0, gt=0, description="How often the adaptive concurrency limit is corrected from latency."
    )
    proxy_runtime_socket: str | None = Field(
        default=None,
        description="HAProxy's runtime API socket (a `stats socket ... level admin`) where HAProxy runs in front "
        "(deploy/haproxy, `python -m serving.front`): the adaptive concurrency limit is published to it as "
        "`proxy_server`'s maxconn, so past capacity HAProxy refuses in place of this server (serving/proxy_limit.py).",
    )
    trust_request_start: bool = Field(
        default=False,
        description="Honour a proxy's X-Request-Start stamp (how long a request waited before this server read "
        "it) in deadlines, admission and the concurrency limit. Only behind a proxy that sets it on every request, "
        "overwriting any client's (deploy/haproxy does; `python -m serving.front` turns this on): a client's own "
        "stamp could move its arrival back up to a minute, and that latency would cut the limit for every client.",
    )
    proxy_server: str = Field(
        default="tandem/score",
        pattern=r"^[A-Za-z0-9_.:-]+/[A-Za-z0-9_.:-]+$",
        description="The HAProxy `backend/server` whose maxconn is this service's concurrency limit.",
    )
    max_transactions_per_request: int = Field(default=256, ge=1)
    request_timeout_ms: float = Field(
        default=2000.0,
        gt=0,
        description="Deadline of a request that sends no X-Deadline-Ms header; a client's own deadline may be "
        "longer, up to max_deadline_ms.",
    )
    cost_decay: float = Field(
        default=0.9, gt=0, lt=1, description="Per-batch forgetting factor of the batch cost estimate."
    )
    torch_threads: int = Field(default=1, ge=1, description="Intra-op threads of the scoring process.")
    polars_threads: int = Field(
        default=1,
        ge=1,
        description="Polars threads of the scoring process (POLARS_MAX_THREADS unless already set).",
    )
    breaker_failure_threshold: int = Field(default=2, ge=1)
    breaker_reset_s: float = Field(default=2.0, gt=0, description="How long an open breaker skips the database.")
    db_connect_timeout_s: int = Field(default=2, ge=1)
    db_statement_timeout_ms: int = Field(default=2000, ge=1)
    write_coalesce_ms: float = Field(
        default=50.0,
        ge=0,
        le=1000,
        description="How long the result writer gathers later batches' answers into the write it is about to "
        "make: fewer, larger writes beside the event loop. The answers are with their clients already; "
        "only their row in the store waits this long. 0 writes each batch on its own.",
    )
    outbox_drain_interval_s: float = Field(default=0.5, gt=0)
    outbox_drain_chunk: int = Field(default=2000, ge=1)
    shutdown_drain_s: float = Field(
        default=10.0,
        ge=0,
        description="At shutdown (SIGTERM), how long one last outbox drain may take before the process exits; "
        "0 skips it. Keep the pod's terminationGracePeriodSeconds above it.",
    )
    idempotency_cache_size: int = Field(default=100_000, ge=0, description="Recent answers kept for retries.")
    model_tag: str | None = Field(
        default=None, description="Pin a model version instead of following the production pointer."
    )
    model_poll_interval_s: float = Field(
        default=2.0,
        ge=0,
        description="How often the production pointer is checked for a promoted (or rolled back) version; "
        "0 turns hot swap off, as does pinning model_tag.",
    )
    shadow_sample: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="Share of admitted, scored items the challenger also scores in shadow while one is set "
        "(`tandem models challenge`); chosen by transaction id, so a retry is sampled alike. 0 turns shadowing off.",
    )
    shadow_queue_capacity: int = Field(default=512, ge=1, description="Sampled items waiting for the challenger.")
    shadow_max_batch: int = Field(default=32, ge=1, le=4096, description="Items per challenger batch at most.")
    shadow_linger_ms: float = Field(
        default=100.0,
        ge=0,
        description="How long sampled items wait for more to fill a challenger batch: each batch has a fixed "
        "cost (history read, features, a write), so fewer, larger batches cost the shared cores less.",
    )
    shadow_max_age_ms: float = Field(
        default=2000.0,
        gt=0,
        description="How long a sampled item may wait for the champion to be idle before it is dropped.",
    )
    shadow_nice: int = Field(
        default=19,
        ge=0,
        le=19,
        description="Scheduling niceness of the challenger's scoring process: on shared cores it gets what the "
        "champion leaves.",
    )
    pool_check_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="How often the server checks that its scoring process is alive, and replaces a dead one.",
    )
    model_load_timeout_s: float = Field(
        default=120.0, gt=0, description="Bound on starting and warming up a new version's scoring process."
    )
    model_retry_max_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest wait before retrying a version that failed to load (doubling from the poll interval).",
    )

    @property
    def backstop_timeout_s(self) -> int:
        """BentoML's timeout: a second past the longest deadline, and no shorter than 10 s."""
        return max(MIN_BACKSTOP_TIMEOUT_S, math.ceil(self.request_timeout_ms / 1000) + 1)

    @property
    def max_deadline_ms(self) -> float:
        """The longest deadline a request gets; a longer one asked for is cut to this, so that the
        service always answers with its own 504 before BentoML's backstop does."""
        return self.backstop_timeout_s * 1000 - 1000.0
