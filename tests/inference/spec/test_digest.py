"""The schema digest: what a model version records of the spec it was trained with."""

from __future__ import annotations

import dataclasses

from inference.spec import Categorical, Numeric, RecordRule, load_spec, schema_digest
from tests.specs import tiny

# The reference spec's digest, pinned: a change means every stored version of risk_model was
# trained with another spec and would be refused, so it must be deliberate.
REFERENCE_DIGEST = "2add5f75da48fcdd"


def test_the_reference_digest_is_pinned() -> None:
    assert load_spec().digest == REFERENCE_DIGEST


def with_field(name: str, replacement: object) -> object:
    return dataclasses.replace(tiny.SPEC, fields=tuple(replacement if f.name == name else f for f in tiny.SPEC.fields))


def test_it_moves_with_what_a_tensor_means() -> None:
    base = schema_digest(tiny.SPEC)
    more_colours = Categorical("colour", vocabulary=(*tiny.COLOURS, "black"), pattern=r"^[a-z]{1,16}$")
    reordered = Categorical("colour", vocabulary=tuple(reversed(tiny.COLOURS)), pattern=r"^[a-z]{1,16}$")
    renamed = Numeric("height", minimum=0.0, maximum=100.0)
    changed = [
        schema_digest(with_field("colour", more_colours)),  # type: ignore[arg-type]
        schema_digest(with_field("colour", reordered)),  # type: ignore[arg-type]
        schema_digest(with_field("level", renamed)),  # type: ignore[arg-type]
        schema_digest(dataclasses.replace(tiny.SPEC, version="2")),
        schema_digest(dataclasses.replace(tiny.SPEC, fields=tuple(reversed(tiny.SPEC.fields)))),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_it_stays_with_what_only_decides_which_records_are_scored() -> None:
    base = schema_digest(tiny.SPEC)
    wider = Numeric("level", minimum=-10.0, maximum=1000.0, below="too_low")
    looser = Categorical("colour", vocabulary=tiny.COLOURS, pattern=r"^[a-z]{1,32}$")
    assert schema_digest(with_field("level", wider)) == base  # type: ignore[arg-type]
    assert schema_digest(with_field("colour", looser)) == base  # type: ignore[arg-type]
    assert schema_digest(dataclasses.replace(tiny.SPEC, history_length=1)) == base
    stricter = RecordRule("level_on_blue", "level", tiny.SPEC.rules[0].refuses)
    assert schema_digest(dataclasses.replace(tiny.SPEC, rules=(stricter,))) == base
    assert schema_digest(dataclasses.replace(tiny.SPEC, title="Readings")) == base
