"""The bench's requests come from the spec it runs: good records its API accepts, poison it refuses,
each under the spec's plural, and every body sent a record id no earlier request used."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from bench.harness import BenchEnv, fresh_bodies, request_bodies
from inference.spec import LoadedSpec, load_spec
from inference.spec.api import record_model
from tests.reference import REFERENCE

DIABETES = load_spec("tandem_specs.diabetes:SPEC")


def bench_env(ls: LoadedSpec) -> BenchEnv:
    return BenchEnv(Path("."), "sqlite://", {}, lambda: None, ls)


def accepted(ls: LoadedSpec, body: dict[str, object]) -> bool:
    (records,) = body.values()
    assert isinstance(records, list) and len(records) == 1
    try:
        record_model(ls)(**records[0])
    except pydantic.ValidationError:
        return False
    return True


@pytest.mark.parametrize("ls", [REFERENCE, DIABETES], ids=lambda ls: ls.spec.name)
def test_good_bodies_are_accepted_and_poison_refused(ls: LoadedSpec) -> None:
    good, poison = request_bodies(bench_env(ls), 300)

    assert len(good) == 300
    assert poison
    assert all(list(body) == [ls.spec.plural] for body in good + poison)
    assert all(accepted(ls, body) for body in good)
    assert not any(accepted(ls, body) for body in poison)


def test_fresh_bodies_never_repeat_an_id() -> None:
    good, _ = request_bodies(bench_env(DIABETES), 50)
    body = fresh_bodies(DIABETES, good, "run")

    ids = [body(i)[0]["patients"][0]["patient_id"] for i in range(120)]

    assert len(set(ids)) == len(ids)
    assert all(record_id.endswith(f"-run-{n}") for n, record_id in enumerate(ids))
