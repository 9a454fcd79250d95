"""Every refusal of the service is a `Refused`, raised where it is found and rendered (JSON
`{"error", "detail"}`, never a bare 500) and counted in one place."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from serving.admission import Decision
from serving.metrics import ServingMetrics
from serving.schemas import REQUEST_ID_HEADER


class Refused(Exception):
    """A request refused with a status, an error code and a reason; `items` of it are counted
    under `outcome` (rejected, shed, expired, failed)."""

    def __init__(
        self,
        status: int,
        error: str,
        detail: Any = None,
        *,
        outcome: str | None = None,
        items: int = 1,
        headers: dict[str, str] | None = None,
        drain_body: bool = False,
    ) -> None:
        super().__init__(error)
        self.drain_body = drain_body  # a body refused for its size, the rest of it still arriving
        self.status = status
        self.error = error
        self.detail = detail
        self.outcome = outcome
        self.items = items
        self.headers = headers or {}

    @classmethod
    def unauthorized(cls, detail: str) -> Refused:
        return cls(401, "unauthorized", detail, headers={"WWW-Authenticate": 'Bearer realm="tandem"'})

    @classmethod
    def overloaded(cls, decision: Decision, *, items: int) -> Refused:
        detail = {
            "reason": decision.reason,
            "predicted_wait_ms": round(decision.predicted_wait_s * 1000, 1),
            # A deadline that passed while the request was read leaves no time, not a negative one.
            "limit_ms": round(max(0.0, decision.limit_s) * 1000, 1),
        }
        return cls(
            503,
            "overloaded",
            detail,
            outcome="shed",
            items=items,
            headers={"Retry-After": str(decision.retry_after_s)},
        )

    @classmethod
    def unavailable(cls, *, items: int) -> Refused:
        # Until the server has replaced its scoring process, fail fast.
        return cls(
            503,
            "unavailable",
            "the scoring process died; a new one is starting",
            outcome="failed",
            items=items,
            headers={"Retry-After": "1"},
        )

    def response(self, metrics: ServingMetrics | None, request_id: str) -> JSONResponse:
        """The one rendering of a refusal: JSON `{"error", "detail"}`, and its items counted."""
        if metrics is not None and self.outcome is not None:
            metrics.items_by_outcome[self.outcome].inc(self.items)
        return JSONResponse(
            {"error": self.error, "detail": self.detail},
            status_code=self.status,
            headers={REQUEST_ID_HEADER: request_id, **self.headers},
        )
