"""Idempotency keys with Stripe's semantics: a key names one request body. The same key and body
get the first answer and write nothing; another body is refused (422); a duplicate of a request
still being answered waits for its answer up to its own deadline, and is admitted on its own when
the first gets none.

Every process and pod must agree, so the store decides: a key is claimed with one atomic INSERT ...
ON CONFLICT DO NOTHING, and the answer is stored beside the claim. A full answer is given only once
the store holds it (or the answer another request stored first): what a client gets is what every
replica replays. Recent keys are also kept in memory, the only judge while the store is unreachable.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from pydantic import TypeAdapter
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from inference.spec.api import RecordBase
from inference.store import (
    KeyClaim,
    claim_idempotency_key,
    complete_idempotency_key,
    release_idempotency_key,
    take_over_idempotency_key,
    utc_now,
)
from inference.store.idempotency import store_idempotency_answer
from serving.breaker import CircuitBreaker, read_reconnecting
from serving.refusals import Refused
from serving.schemas import ItemResult

logger = logging.getLogger(__name__)

IDEMPOTENCY_REUSED = "idempotency_key_reused"
IDEMPOTENCY_IN_PROGRESS = "idempotency_key_in_progress"
# How often a duplicate polls the store for the answer another process is computing.
_POLL_S = 0.01
_T = TypeVar("_T")


def _new_future() -> asyncio.Future[list[ItemResult]]:
    return asyncio.get_running_loop().create_future()


class KeyReused(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(f"Idempotency-Key {key!r} was already used with a different request body")
        self.key = key


class _OwnerGaveUp(Exception):
    """The request a duplicate waited on got no answer: the duplicate is admitted on its own."""


class KeyInProgress(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(f"a request with Idempotency-Key {key!r} is still being answered; retry shortly")
        self.key = key


def _not_kept(key: str, items: int) -> Refused:
    """A full answer the store did not take is not given: a retry would be scored afresh, and a
    client holding it would find another answer under its key."""
    message = f"the answer under Idempotency-Key {key!r} could not be stored; retry"
    return Refused(503, "store_unavailable", message, outcome="failed", items=items, headers={"Retry-After": "1"})


def _in_transaction(work: Callable[[Connection], _T], conn: Connection) -> _T:
    with conn.begin():
        return work(conn)


def request_fingerprint(records: Sequence[RecordBase]) -> str:
    """The body as the key names it: its transactions in order, in canonical form (so JSON
    whitespace, key order and equivalent timestamp spellings are one body)."""
    canonical = json.dumps([tx.to_raw() for tx in records], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(eq=False)
class _LocalKey:
    """A key this process is answering now: duplicates wait for `answered`."""

    fingerprint: str
    answered: asyncio.Future[list[ItemResult]] = field(default_factory=_new_future)


def _give_up(owner: _LocalKey, error: BaseException) -> None:
    if not owner.answered.done():
        owner.answered.set_exception(error)
        owner.answered.exception()  # retrieved here, so an unwaited future logs nothing


def _outcome_write(key: str, request_id: str, response: str | None) -> Callable[[Connection], bool]:
    """A claim's outcome as one store write: its answer, or (None) its release. True once done."""

    def write(conn: Connection) -> bool:
        if response is None:
            release_idempotency_key(conn, key=key, request_id=request_id)
        else:
            complete_idempotency_key(conn, key=key, request_id=request_id, response=response)
        return True

    return write


# A key this process has answered: (fingerprint, the answer as JSON), plain values that the
# garbage collector stops tracking.
_Answered = tuple[str, bytes]


@dataclass(frozen=True)
class Admission:
    """What a keyed request does next: replay `results`, or score and then `complete` or `release`."""

    results: list[ItemResult] | None
    owner: _LocalKey | None
    claimed_in_store: bool


class IdempotencyKeys:
    def __init__(
        self,
        engine: Engine,
        breaker: CircuitBreaker,
        *,
        results: TypeAdapter[list[ItemResult]],
        stale_after_s: float,
        size: int = 100_000,
    ) -> None:
        """`results`: the spec's item results as stored answers hold them. `stale_after_s`: an
        unanswered claim older than this belongs to a process that died."""
        self.engine = engine
        self.results = results
        self.breaker = breaker
        self.size = size
        self.stale_after_s = stale_after_s
        self._local: collections.OrderedDict[str, _LocalKey | _Answered] = collections.OrderedDict()
        # Outcomes the store did not take (an outage): (key, request_id) -> the answer's JSON, or
        # None to release the claim; written with the next outcome it takes, so no claim stays unanswered.
        self._unstored: collections.OrderedDict[tuple[str, str], str | None] = collections.OrderedDict()
        self._unstored_lock = threading.Lock()

    async def admit(self, key: str, fingerprint: str, *, request_id: str, deadline: float) -> Admission:
        """Raises KeyReused; KeyInProgress past `deadline` while the key's first request is being
        answered; TimeoutError past it once that request gave up unanswered."""
        local = self._local.get(key)
        if isinstance(local, tuple):
            answered_fingerprint, answer = local
            if answered_fingerprint != fingerprint:
                raise KeyReused(key)
            self._local.move_to_end(key)
            return Admission(self.results.validate_json(answer), None, False)
        if local is not None:
            if local.fingerprint != fingerprint:
                raise KeyReused(key)
            self._local.move_to_end(key)
            try:
                results = await asyncio.wait_for(asyncio.shield(local.answered), timeout=deadline - time.monotonic())
            except TimeoutError:
                # The first request under the key is still being answered: told so, as across processes.
                raise KeyInProgress(key) from None
            except _OwnerGaveUp:
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
                return await self.admit(key, fingerprint, request_id=request_id, deadline=deadline)
            return Admission(results, None, False)
        owner = _LocalKey(fingerprint)
        self._remember(key, owner)
        try:
            claim = await self._claim(key, fingerprint, request_id)
            if claim is not None and not claim.owned_by(request_id):
                replay = await self._answer_of_other(key, fingerprint, claim, request_id, deadline)
                if replay is not None:
                    self._answered(key, owner, replay)
                    return Admission(replay, None, False)
        except BaseException as error:
            self._forget(key, owner)
            # A reuse refuses the duplicates too; this attempt's own deadline or cancellation does not.
            _give_up(owner, error if isinstance(error, KeyReused) else _OwnerGaveUp())
            raise
        return Admission(None, owner, claim is not None)

    async def complete(
        self, key: str, admission: Admission, results: list[ItemResult], *, request_id: str, deadline: float
    ) -> list[ItemResult]:
        """The answer to give under `key`. A degraded one is not kept: a retry once the store is back
        deserves the full answer. A full one is given only once the store holds it as the key's answer,
        and then as the store holds it (another request's, if that one stored first).

        Raises TimeoutError past `deadline`; Refused (503, Retry-After) when the store did not
        take it; KeyInProgress or KeyReused when the store gave the key to another request."""
        owner = admission.owner
        assert owner is not None
        if any(result.degraded for result in results):
            self._forget(key, owner)
            owner.answered.set_result(results)
            self._release_claim(key, admission, request_id)
            return results
        storing = asyncio.ensure_future(
            asyncio.to_thread(self._store_answer, key, owner.fingerprint, request_id, results)
        )
        # Settled whether or not this request is still waiting: duplicates get the stored answer.
        storing.add_done_callback(functools.partial(self._settle, key, owner))
        return await asyncio.wait_for(asyncio.shield(storing), timeout=max(deadline - time.monotonic(), 0.0))

    def release(self, key: str, admission: Admission, *, request_id: str) -> None:
        """The request got no answer: the key is free for a retry, and each duplicate waiting on it
        is admitted on its own rather than handed this request's error."""
        assert admission.owner is not None
        self._forget(key, admission.owner)
        _give_up(admission.owner, _OwnerGaveUp())
        self._release_claim(key, admission, request_id)

    def _release_claim(self, key: str, admission: Admission, request_id: str) -> None:
        """Free the key's claim in the store, off the event loop."""
        if admission.claimed_in_store:
            asyncio.get_running_loop().run_in_executor(None, self.store_outcome, key, request_id, None)

    def _settle(self, key: str, owner: _LocalKey, storing: asyncio.Future[list[ItemResult]]) -> None:
        if not storing.cancelled() and storing.exception() is None:
            self._answered(key, owner, storing.result())
        else:
            self._forget(key, owner)
            _give_up(owner, _OwnerGaveUp())

    # ------------------------------------------------------------------ the store (blocking; off the loop)
    def _store_answer(self, key: str, fingerprint: str, request_id: str, results: list[ItemResult]) -> list[ItemResult]:
        """`results` stored as `key`'s answer, claiming the key if the claim never reached the store;
        returns the answer the store holds. Raises as `complete` does."""
        response = self.results.dump_json(results).decode()
        # In a list: None from the store means "held as this answer", None from `_guarded` "not stored".
        stored = self._guarded(
            lambda conn: [
                store_idempotency_answer(
                    conn, key=key, request_hash=fingerprint, request_id=request_id, response=response
                )
            ]
        )
        if stored is None:
            self.store_outcome(key, request_id, None)  # a claim that landed is freed for the retry
            raise _not_kept(key, len(results))
        (other,) = stored
        if other is None or other.response == response:
            return results
        if other.request_hash != fingerprint:
            raise KeyReused(key)
        if other.response is None:
            raise KeyInProgress(key)
        return self.results.validate_json(other.response)

    def store_outcome(self, key: str, request_id: str, response: str | None) -> None:
        """Store a claim's answer, or (None) its release, then the outcomes that waited for the store;
        each one it does not take waits for the next (behind the others, so none holds the rest back)."""
        with self._unstored_lock:
            outcomes = [((key, request_id), response), *self._unstored.items()]
            self._unstored.clear()
        for (outcome_key, outcome_request), outcome_response in outcomes:
            if self._guarded(_outcome_write(outcome_key, outcome_request, outcome_response)) is not None:
                continue
            with self._unstored_lock:
                self._unstored[(outcome_key, outcome_request)] = outcome_response
                while len(self._unstored) > self.size:
                    self._unstored.popitem(last=False)

    async def _claim(self, key: str, fingerprint: str, request_id: str) -> KeyClaim | None:
        claim = await self._claiming(
            functools.partial(claim_idempotency_key, key=key, request_hash=fingerprint, request_id=request_id),
            key,
            request_id,
        )
        if claim is not None and claim.request_hash != fingerprint:
            raise KeyReused(key)
        return claim

    async def _answer_of_other(
        self, key: str, fingerprint: str, claim: KeyClaim, request_id: str, deadline: float
    ) -> list[ItemResult] | None:
        """The answer another request (maybe another process) gave or is giving under `key`;
        None when this request takes the claim over from a process that died holding it."""
        while True:
            if claim.response is not None:
                return self.results.validate_json(claim.response)
            if claim.created_at < utc_now() - timedelta(seconds=self.stale_after_s):
                take_over = functools.partial(
                    take_over_idempotency_key,
                    key=key,
                    request_id=request_id,
                    claimed_before=claim.created_at + timedelta(microseconds=1),
                )
                taken = await self._claiming(take_over, key, request_id)
                if taken:
                    return None
            if time.monotonic() + _POLL_S >= deadline:
                raise KeyInProgress(key)
            await asyncio.sleep(_POLL_S)
            again = await self._claim(key, fingerprint, request_id)
            if again is None:  # the store went away meanwhile
                raise KeyInProgress(key)
            if again.owned_by(request_id):  # the other request gave up its claim and this one took it
                return None
            claim = again

    async def _claiming(self, work: Callable[[Connection], _T], key: str, request_id: str) -> _T | None:
        """`work` (a claim or a take-over) off the event loop. Cancelled meanwhile, the thread still
        commits the claim: it is released once it lands, or every retry would get 409 until it went stale."""
        claiming = asyncio.ensure_future(asyncio.to_thread(self._guarded, work))
        try:
            return await asyncio.shield(claiming)
        except asyncio.CancelledError:
            loop = asyncio.get_running_loop()
            claiming.add_done_callback(lambda _: loop.run_in_executor(None, self.store_outcome, key, request_id, None))
            raise

    def _guarded(self, work: Callable[[Connection], _T]) -> _T | None:
        """`work` in one transaction, once more on a fresh connection if the server dropped this one
        (each statement here is safe to run again), or None when the store is unreachable (breaker
        open) or failed."""
        if not self.breaker.allow():
            return None
        try:
            result = read_reconnecting(self.engine, functools.partial(_in_transaction, work), self.breaker)
        except SQLAlchemyError as error:
            self.breaker.record_failure()
            logger.warning("idempotency store unavailable; this process's memory decides: %s", error)
            return None
        self.breaker.record_success()
        return result

    # ------------------------------------------------------------------ this process's memory
    def _remember(self, key: str, entry: _LocalKey) -> None:
        self._local[key] = entry
        while len(self._local) > self.size:
            self._local.popitem(last=False)

    def _forget(self, key: str, entry: _LocalKey) -> None:
        if self._local.get(key) is entry:
            del self._local[key]

    def _answered(self, key: str, owner: _LocalKey, results: list[ItemResult]) -> bytes:
        """Hand `results` to the duplicates waiting on `owner`, and keep the key (in its place)
        as its answer's JSON from now on; returns that JSON."""
        owner.answered.set_result(results)
        answer = self.results.dump_json(results)
        if self._local.get(key) is owner:
            self._local[key] = (owner.fingerprint, answer)
        return answer
