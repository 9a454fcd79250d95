"""Which failures a retry can fix: database connectivity, yes; anything else, no."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import Backoff, Failure, Jitter, RetryPolicy
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

# Per-partition step retries. The run-level retry (dagster.yaml) is for lost run workers and is
# configured not to re-run steps that already succeeded, so the two never multiply.
TRANSIENT_RETRY = RetryPolicy(max_retries=3, delay=2, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)


def is_transient(error: BaseException) -> bool:
    if isinstance(error, OperationalError | InterfaceError):
        return True
    return isinstance(error, DBAPIError) and bool(error.connection_invalidated)


@contextmanager
def retry_only_transient_errors() -> Iterator[None]:
    """Let transient database errors through to the RetryPolicy; fail everything else at once.

    A poison row never gets here (it is quarantined); a bug would fail identically on every
    retry, so retrying it only delays the alert.
    """
    try:
        yield
    except Exception as error:
        if is_transient(error):
            raise
        raise Failure(description=f"{type(error).__name__}: {error}", allow_retries=False) from error
