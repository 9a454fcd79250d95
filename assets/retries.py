"""Which failures a retry can fix: a transient database error, yes; anything else, no."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dagster import Backoff, Failure, Jitter, RetryPolicy

from inference.store import is_transient_db_error

# Per-partition step retries. The run-level retry (dagster.yaml) is for lost run workers and is
# configured not to re-run steps that already succeeded, so the two never multiply.
TRANSIENT_RETRY = RetryPolicy(max_retries=3, delay=2, backoff=Backoff.EXPONENTIAL, jitter=Jitter.PLUS_MINUS)


@contextmanager
def retry_only_transient_errors() -> Iterator[None]:
    """Let transient database errors (`is_transient_db_error`, the core's one rule) through to the
    RetryPolicy; fail everything else at once.

    A poison row never gets here (it is quarantined); a bug or a missing migration would fail
    identically on every retry, so retrying it only delays the alert.
    """
    try:
        yield
    except Failure:
        raise  # the asset's own verdict, already worded for the UI
    except Exception as error:
        if is_transient_db_error(error):
            raise
        raise Failure(description=f"{type(error).__name__}: {error}", allow_retries=False) from error


@contextmanager
def fail_at_once(what: str) -> Iterator[None]:
    """For work no retry can fix (loading the production model: the store on disk, not the
    database): any error fails the step at once, its description saying `what` failed."""
    try:
        yield
    except Exception as error:
        raise Failure(description=f"{what}: {type(error).__name__}: {error}", allow_retries=False) from error
