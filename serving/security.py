"""The service's edge: an optional bearer token and request-size limits, applied before any work.
The token is a `SecretStr`, so no repr or settings dump in a log shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.requests import ClientDisconnect, Request

from serving.refusals import Refused

MIB = 1024 * 1024
BEARER_PREFIX = "bearer "
# How much of a refused body is read and dropped, and for how long, before the 413 goes to a
# client that asked to close the connection (see drain_before_close).
DRAIN_LIMIT_BYTES = 64 * MIB
DRAIN_TIMEOUT_S = 5.0


class SecuritySettings(BaseSettings):
    """Its own class (same TANDEM_SERVING_ prefix as ServingSettings, which ignores these keys)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_SERVING_", extra="ignore")

    auth_token: SecretStr | None = Field(
        default=None,
        description="When set, POST /score and GET /lineage/{id} need `Authorization: Bearer <token>`.",
    )
    max_body_bytes: int = Field(default=MIB, ge=1, description="Largest request body accepted; larger is 413.")

    @field_validator("auth_token", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: object) -> object:
        # An empty variable (TANDEM_SERVING_AUTH_TOKEN=) must not turn on auth with an empty token.
        return None if isinstance(value, str) and not value.strip() else value


class BearerAuth:
    def __init__(self, token: SecretStr | None) -> None:
        self._expected = token.get_secret_value().encode() if token is not None else None

    @property
    def enabled(self) -> bool:
        return self._expected is not None

    def check(self, authorization: str | None) -> Refused | None:
        """None when the request may pass; the refusal never echoes what the client sent."""
        if self._expected is None:
            return None
        if authorization is None:
            return Refused.unauthorized("missing Authorization: Bearer <token> header")
        if authorization[: len(BEARER_PREFIX)].lower() != BEARER_PREFIX:
            return Refused.unauthorized("Authorization must use the Bearer scheme")
        # Starlette decodes header bytes as latin-1; encoding back recovers exactly what was sent.
        presented = authorization[len(BEARER_PREFIX) :].strip().encode("latin-1")
        # Constant time in the token's contents, so response timing does not leak a prefix match.
        if not hmac.compare_digest(presented, self._expected):
            return Refused.unauthorized("invalid bearer token")
        return None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` bytes: by its
    Content-Length before reading, or while it streams in, so it costs at most `limit` bytes.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            length = -1
        if length < 0:
            raise Refused(400, "bad_header", "Content-Length must be a non-negative integer")
        if length > limit:
            raise _too_large(limit)
    received = bytearray()
    try:
        async for chunk in request.stream():
            received += chunk
            if len(received) > limit:
                raise _too_large(limit)
    except ClientDisconnect as gone:
        raise Refused(400, "client_disconnected", "the body ended before it was complete") from gone
    return bytes(received)


async def drain_before_close(request: Request, *, within_s: float) -> None:
    """Read and drop the rest of a body refused for its size when the client asked for
    `Connection: close`, before answering: closing with body still arriving makes the kernel reset
    the connection, and a client that sends its whole body first sees a reset instead of its 413.
    Bounded in bytes and time, as nginx's lingering close, and by the request's deadline
    (`within_s` from now): past it the answer is due, reset or not.
    """
    if "close" not in request.headers.get("connection", "").lower() or "expect" in request.headers:
        return
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > DRAIN_LIMIT_BYTES:
        return
    drained = 0
    with contextlib.suppress(ClientDisconnect, TimeoutError):
        async with asyncio.timeout(min(DRAIN_TIMEOUT_S, max(within_s, 0.0))):
            try:
                async for chunk in request.stream():
                    drained += len(chunk)
                    if drained > DRAIN_LIMIT_BYTES:
                        return
            except RuntimeError:  # starlette's "Stream consumed": the chunk refused was the last one
                return


def _too_large(limit: int) -> Refused:
    # drain_body: refused for its size, with the rest still on its way.
    return Refused(413, "payload_too_large", f"request body over {limit} bytes", drain_body=True)


__all__ = ["BearerAuth", "SecuritySettings", "drain_before_close", "read_body"]
