"""A circuit breaker in front of the database, so a dead database costs no latency; and a bound on
each statement, so a silent one cannot hold a read for good.

After `failure_threshold` consecutive failures it opens: callers skip the database for `reset_s`.
Then one probe: by a `probe` function on a thread of its own when one is given, so that no request
waits out a silent database's connect timeout, else by the next caller. Success closes it, failure
opens it again. Thread-safe; one per process.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine, ExceptionContext
from sqlalchemy.exc import DBAPIError

logger = logging.getLogger(__name__)
_R = TypeVar("_R")


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
        probe: Callable[[], object] | None = None,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._probe = probe
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        # When the half-open probe was handed out; None: no probe out.
        self._probe_since: float | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        """Whether this caller may try the database now (claims the probe when half-open and no
        `probe` function was given)."""
        with self._lock:
            state = self._state_locked()
            if state is BreakerState.CLOSED:
                return True
            if state is not BreakerState.HALF_OPEN:
                return False
            now = self._clock()
            # A caller's probe unanswered for reset_s is given up: its caller recorded neither
            # outcome, and held for good it would keep the breaker refusing everyone. A probe
            # thread always answers.
            if self._probe_since is not None and (self._probe is not None or now - self._probe_since < self.reset_s):
                return False
            self._probe_since = now
            if self._probe is None:
                return True
        threading.Thread(target=self._run_probe, name="tandem-breaker-probe", daemon=True).start()
        return False

    def _run_probe(self) -> None:
        assert self._probe is not None
        try:
            self._probe()
        except Exception:  # noqa: BLE001 - whatever failed, the database is not back: open for reset_s
            self.record_failure()
        else:
            self.record_success()

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probe_since = None

    def trip(self) -> None:
        """Open now, whatever the count: a database that let a statement wait out its bound will
        not answer the next caller either."""
        with self._lock:
            self._opened_at = self._clock()

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probe_since = None
            if self._opened_at is not None or self._failures >= self.failure_threshold:
                self._opened_at = self._clock()


class StatementBound:
    """Cuts the connection of a PostgreSQL statement still running `seconds` after it started.

    statement_timeout is the server's, so it cannot end a wait on a server that does not answer:
    a pooler whose database is gone queues the statement (PgBouncer: two minutes), a frozen host
    never replies. Cut, the statement fails as a dropped connection does, and `on_cut` (a
    breaker's `trip`) keeps the next statements off that database. One watchdog thread per
    process, armed and disarmed per statement by engine events.
    """

    def __init__(self, seconds: float, on_cut: Callable[[], object] = lambda: None) -> None:
        self.seconds = seconds
        self.on_cut = on_cut
        self._armed: dict[int, tuple[float, Any]] = {}  # id(connection) -> (deadline, DBAPI connection)
        self._changed = threading.Condition()
        self._watchdog: threading.Thread | None = None

    def watch(self, engine: Engine) -> None:
        """Bound every statement `engine` runs on PostgreSQL through psycopg (3 or 2), whose
        connections name their socket; a no-op elsewhere (SQLite: a file always answers)."""
        if engine.dialect.name != "postgresql" or engine.dialect.driver not in ("psycopg", "psycopg2"):
            return
        event.listen(engine, "before_cursor_execute", self._arm)
        event.listen(engine, "after_cursor_execute", self._disarm)
        event.listen(engine, "handle_error", self._disarm_failed)

    def _arm(self, conn: Connection, *_: object) -> None:
        with self._changed:
            self._armed[id(conn)] = (time.monotonic() + self.seconds, conn.connection.driver_connection)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="tandem-statement-bound", daemon=True)
                self._watchdog.start()
            elif len(self._armed) == 1:
                self._changed.notify()  # every later deadline is after this one: only an idle watchdog waits for it

    def _disarm(self, conn: Connection, *_: object) -> None:
        with self._changed:
            self._armed.pop(id(conn), None)

    def _disarm_failed(self, context: ExceptionContext) -> None:
        if context.connection is not None:
            self._disarm(context.connection)

    def _watch(self) -> None:
        with self._changed:
            while True:
                now = time.monotonic()
                for key, (deadline, driver) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        # on_cut first: the statement's caller, woken by the cut, must find the
                        # breaker open already, or it retries on a fresh connection to that database.
                        try:
                            self.on_cut()
                        except Exception:  # the watchdog must outlive its callback
                            logger.exception("statement bound: on_cut failed")
                        _cut(driver)
                        logger.warning("statement bound: cut a statement unanswered after %g s", self.seconds)
                waits = [deadline - now for deadline, _ in self._armed.values()]
                self._changed.wait(min(waits) if waits else None)


def _cut(driver: Any) -> None:
    """Shut the connection's socket down both ways: the statement's next read fails at once. The
    socket is asked of the connection now: one closed meanwhile has none (psycopg raises), where a
    file descriptor kept from before could name another file by now."""
    with contextlib.suppress(Exception), socket.socket(fileno=os.dup(driver.fileno())) as connection:
        connection.shutdown(socket.SHUT_RDWR)


def read_reconnecting(engine: Engine, read: Callable[[Connection], _R], breaker: CircuitBreaker | None = None) -> _R:
    """`read` on a pooled connection, once more on a fresh one if the server had dropped it (a
    restart): SQLAlchemy's optimistic disconnect handling, in place of a ping before every read.
    Not once `breaker` has opened: a statement cut by its bound tripped it, and a fresh connection
    to a silent database would hold the batch for the connect timeout as well."""
    try:
        with engine.connect() as conn:
            return read(conn)
    except DBAPIError as error:
        if not error.connection_invalidated or (breaker is not None and breaker.state is not BreakerState.CLOSED):
            raise
    with engine.connect() as conn:
        return read(conn)
