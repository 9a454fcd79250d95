"""Request ids: 32 hex digits as uuid4().hex was, unique within a process and apart in a forked
child (each worker draws its own prefix); and a metric's bound children are the `labels()` ones."""

from __future__ import annotations

import os
import re

from prometheus_client import CollectorRegistry, Counter

from serving.gate import new_request_id
from serving.metrics import Children


def test_request_ids_are_32_hex_digits_and_never_repeat() -> None:
    ids = [new_request_id() for _ in range(10_000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", request_id) for request_id in ids)
    assert len(set(ids)) == len(ids)


def test_a_forked_child_draws_its_own_prefix() -> None:
    parent = new_request_id()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next id and leave without running the parent's cleanup
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert re.fullmatch(r"[0-9a-f]{32}", child)
    # Same counter position is possible; the 64-bit prefix is what must differ.
    assert child[:16] != parent[:16]


def test_children_are_the_labelled_series_bound_once() -> None:
    registry = CollectorRegistry()
    counter = Counter("tandem_test_total", "test", ["reason"], registry=registry)
    children = Children(counter, "reason", exported=("a",))
    assert registry.get_sample_value("tandem_test_total", {"reason": "a"}) == 0.0
    assert children["b"] is children["b"] is counter.labels(reason="b")
    children["b"].inc(3)
    assert registry.get_sample_value("tandem_test_total", {"reason": "b"}) == 3.0
