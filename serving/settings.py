"""Knobs of the online path, resolved when the service starts (never at import time)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# BentoML's own per-request timeout (`traffic.timeout`) is a backstop behind the requests' deadlines
# (BentoML requires one > 0); a request's deadline is cut to a second under it, so Tandem answers first.
MIN_BACKSTOP_TIMEOUT_S = 10
DB_CONNECT_TIMEOUT_S = 2  # a database that does not answer this fast is down: the breaker takes over
# A database gone silent mid-read (a partition, a host that failed over) is found out by the kernel
# within about 2 s, not TCP's 15 minutes: the read fails and the breaker takes over.
DB_SILENCE_BOUND = {
    "keepalives": 1,
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 2000,  # ms that sent data may stay unacknowledged
}


class ServingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_SERVING_", extra="ignore", validate_by_name=True)

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
    queue_capacity: int = Field(
        default=1024, ge=1, description="Hard bound on queued items, whatever the predicted wait says."
    )
    max_concurrency: int = Field(
        default=128,
        ge=1,
        description="The ceiling of the AIMD limit on admitted requests in flight (admission.AimdLimit), where it "
        "starts: a burst up to it is admitted whole while answers stay within the p99 target.",
    )
    max_records_per_request: int = Field(
        default=256,
        ge=1,
        # The second name is the one the reference spec's deployments were configured with.
        validation_alias=AliasChoices(
            "TANDEM_SERVING_MAX_RECORDS_PER_REQUEST", "TANDEM_SERVING_MAX_TRANSACTIONS_PER_REQUEST"
        ),
        description="The most records one request may list; more is refused with 413.",
    )
    request_timeout_ms: float = Field(
        default=2000.0,
        gt=0,
        description="Deadline of a request that sends no X-Deadline-Ms header; a client's own deadline may be "
        "longer, up to max_deadline_ms.",
    )
    torch_threads: int = Field(default=1, ge=1, description="Intra-op threads of the scoring process.")
    breaker_failure_threshold: int = Field(default=2, ge=1)
    breaker_reset_s: float = Field(default=2.0, gt=0, description="How long an open breaker skips the database.")
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
    shutdown_drain_s: float = Field(
        default=10.0,
        ge=0,
        description="At shutdown (SIGTERM), how long one last outbox drain may take before the process exits; "
        "0 skips it. Keep the pod's terminationGracePeriodSeconds above it.",
    )
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
        "(`tandem models challenge`); chosen by record id, so a retry is sampled alike. 0 turns shadowing off.",
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

    @property
    def statement_bound_s(self) -> float:
        """How long a statement may wait before its connection is cut (`breaker.StatementBound`): a
        second past the server's statement_timeout, so that a server that answers refuses first."""
        return self.db_statement_timeout_ms / 1000 + 1.0

    def engine_options(self, url: str) -> dict[str, Any]:
        """PostgreSQL connections that fail fast (connect, statement, silence): the breaker and the
        outbox take over from there."""
        if not url.startswith("postgresql"):
            return {}
        statement_timeout = f"-c statement_timeout={self.db_statement_timeout_ms}"
        return {
            "connect_args": {"connect_timeout": DB_CONNECT_TIMEOUT_S, "options": statement_timeout, **DB_SILENCE_BOUND}
        }
