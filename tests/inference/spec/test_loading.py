"""Loading a spec by its import path: each refusal is one exact line."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inference.spec import (
    Categorical,
    EntityKey,
    EventTime,
    Label,
    ModelSpec,
    Numeric,
    RecordId,
    RecordRule,
    SpecError,
    configured_spec,
    load_spec,
)
from tests.specs import tiny

MODULE = "tandem_test_specs_under_test"


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    """An importable module to put specs in, fresh for each test (load_spec caches per path)."""
    created = types.ModuleType(MODULE)
    sys.modules[MODULE] = created
    load_spec.cache_clear()
    yield created
    del sys.modules[MODULE]
    load_spec.cache_clear()


def refusal(module: types.ModuleType, spec: object) -> str:
    module.SPEC = spec  # type: ignore[attr-defined]
    with pytest.raises(SpecError) as refused:
        load_spec(f"{MODULE}:SPEC")
    text = str(refused.value)
    assert "\n" not in text
    prefix = f"spec '{MODULE}:SPEC': "
    assert text.startswith(prefix)
    return text.removeprefix(prefix)


def test_the_reference_and_the_tiny_spec_load() -> None:
    reference = load_spec()
    assert reference.id.name == "transaction_id"
    assert reference.entity is not None and reference.entity.name == "account_id"
    assert reference.table == "transactions"
    assert [f.name for f in reference.categoricals] == ["currency", "merchant_category", "country"]
    loaded = load_spec("tests.specs.tiny:SPEC")
    assert loaded.spec is tiny.SPEC
    assert loaded.field_names == ("reading_id", "sensor_id", "level", "colour", "taken_at")


def test_a_path_that_names_no_spec_is_refused_in_one_line() -> None:
    with pytest.raises(SpecError, match=r"^spec 'tests.specs.tiny': expected package.module:attribute$"):
        load_spec("tests.specs.tiny")
    missing = r"cannot import 'no_such_pkg.mod' \(No module named 'no_such_pkg'; is its package installed or on PYTHONP"
    with pytest.raises(SpecError, match=missing):
        load_spec("no_such_pkg.mod:SPEC")
    with pytest.raises(SpecError, match=r"module 'tests.specs.tiny' has no attribute 'NOPE'$"):
        load_spec("tests.specs.tiny:NOPE")
    with pytest.raises(SpecError, match=r"COLOURS is a tuple, not an inference.spec.ModelSpec$"):
        load_spec("tests.specs.tiny:COLOURS")


def test_tandem_model_spec_picks_the_spec_and_names_itself_when_it_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_MODEL_SPEC", raising=False)
    assert configured_spec() is load_spec()
    monkeypatch.setenv("TANDEM_MODEL_SPEC", "tests.specs.tiny:SPEC")
    assert configured_spec() is load_spec("tests.specs.tiny:SPEC")
    monkeypatch.setenv("TANDEM_MODEL_SPEC", "tests.specs.tiny:COLOURS")
    refusal = (
        r"^TANDEM_MODEL_SPEC: spec 'tests.specs.tiny:COLOURS': COLOURS is a tuple, not an inference.spec.ModelSpec$"
    )
    with pytest.raises(SpecError, match=refusal):
        configured_spec()


def test_a_module_that_fails_on_import_is_named_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tandem_broken_spec.py").write_text("raise RuntimeError('the team forgot a file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        SpecError,
        match=r"^spec 'tandem_broken_spec:SPEC': cannot import 'tandem_broken_spec' "
        r"\(RuntimeError: the team forgot a file\)$",
    ):
        load_spec("tandem_broken_spec:SPEC")


def test_roles_and_history(module: types.ModuleType) -> None:
    no_entity = dataclasses.replace(
        tiny.SPEC, fields=tuple(f for f in tiny.SPEC.fields if not isinstance(f, EntityKey))
    )
    assert refusal(module, no_entity) == "history_length 2 needs an EntityKey"
    load_spec.cache_clear()
    two_ids = dataclasses.replace(tiny.SPEC, fields=(*tiny.SPEC.fields, RecordId("other_id")))
    assert refusal(module, two_ids) == "needs exactly one RecordId, has 2"
    load_spec.cache_clear()
    no_time = dataclasses.replace(
        tiny.SPEC, history_length=0, fields=tuple(f for f in tiny.SPEC.fields if not isinstance(f, EventTime))
    )
    assert refusal(module, no_time) == "needs exactly one EventTime, has 0"
    load_spec.cache_clear()
    assert refusal(module, dataclasses.replace(tiny.SPEC, history_length=300)) == "history_length 300 outside 0..256"


def test_names(module: types.ModuleType) -> None:
    reserved = dataclasses.replace(tiny.SPEC, fields=(*tiny.SPEC.fields, Numeric("event_ts")))
    assert refusal(module, reserved) == "field 'event_ts' is a reserved column"
    load_spec.cache_clear()
    prefixed = dataclasses.replace(tiny.SPEC, label=Label("previous_level"))
    assert refusal(module, prefixed) == "field 'previous_level' is a reserved column"
    load_spec.cache_clear()
    twice = dataclasses.replace(tiny.SPEC, fields=(*tiny.SPEC.fields, Numeric("level")))
    assert refusal(module, twice) == (
        "two fields named 'level'; reason code 'level_unparsable' twice; reason code 'level_not_finite' twice"
    )
    load_spec.cache_clear()
    upper = dataclasses.replace(tiny.SPEC, name="Readings")
    assert refusal(module, upper) == "name 'Readings' is not a lower-case name (letters, digits and _, at most 41)"


def test_vocabularies_and_codes(module: types.ModuleType) -> None:
    odd = Categorical("colour", vocabulary=("red", "Green"), pattern=r"^[a-z]{1,16}$")
    fields = tuple(odd if f.name == "colour" else f for f in tiny.SPEC.fields)
    assert refusal(module, dataclasses.replace(tiny.SPEC, fields=fields)) == (
        "vocabulary value 'Green' of 'colour' does not match its pattern"
    )
    load_spec.cache_clear()
    clash = RecordRule("malformed_colour", "colour", tiny.SPEC.rules[0].refuses)
    assert refusal(module, dataclasses.replace(tiny.SPEC, rules=(clash,))) == "reason code 'malformed_colour' twice"
    load_spec.cache_clear()
    nowhere = RecordRule("odd", "nothing", tiny.SPEC.rules[0].refuses)
    assert refusal(module, dataclasses.replace(tiny.SPEC, rules=(nowhere,))) == "rule 'odd' names no field 'nothing'"
    load_spec.cache_clear()
    partial = dataclasses.replace(tiny.SPEC, reason_order=("nul_character", "mystery"))
    assert refusal(module, partial) == (
        "reason_order names no reason 'mystery'; reason_order leaves out duplicate_id, level_above_maximum, "
        "level_below_minimum, level_not_finite, level_on_red, level_unparsable, malformed_colour, missing_field, "
        "timestamp_missing, timestamp_unparsable"
    )


def test_categorical_lengths_and_a_spec_that_does_not_hash(module: types.ModuleType) -> None:
    short = Categorical("colour", vocabulary=("red",), min_length=5, max_length=4)
    fields = tuple(short if f.name == "colour" else f for f in tiny.SPEC.fields)
    assert refusal(module, dataclasses.replace(tiny.SPEC, fields=fields)) == (
        "categorical 'colour' needs 1 <= min_length <= max_length"
    )
    load_spec.cache_clear()

    @dataclasses.dataclass
    class Columns:  # compared by value but not frozen: unhashable
        def __call__(self) -> dict[str, object]:
            return {}

    assert refusal(module, _spec(encode=Columns())) == (
        "is not hashable (unhashable type: 'Columns'): give its hooks as functions or classes"
    )


def test_every_problem_is_named_at_once(module: types.ModuleType) -> None:
    bad = dataclasses.replace(
        tiny.SPEC, name="Bad Name", history_length=-1, fields=(*tiny.SPEC.fields, RecordId("record_id"))
    )
    assert refusal(module, bad).split("; ") == [
        "name 'Bad Name' is not a lower-case name (letters, digits and _, at most 41)",
        "field 'record_id' is a reserved column",
        "needs exactly one RecordId, has 2",
        "history_length -1 outside 0..256",
    ]


def test_a_spec_without_history_needs_no_entity(module: types.ModuleType) -> None:
    flat = ModelSpec(
        name="patients",
        model_name="patient_model",
        version="1",
        fields=(RecordId("patient_id"), Numeric("age", minimum=0, maximum=120), EventTime("visit_time")),
        history_length=0,
        encode=dict,
        features=tiny.features,
        model=tiny.TinyModel,
        model_config=lambda k: {"history_length": k},
        example=lambda: {"patient_id": "p-1", "age": 40, "visit_time": "2026-11-01T08:00:00Z"},
    )
    module.SPEC = flat  # type: ignore[attr-defined]
    loaded = load_spec(f"{MODULE}:SPEC")
    assert loaded.entity is None and loaded.categoricals == () and loaded.table == "patients"


def test_training_defaults_must_be_positive_whole_numbers() -> None:
    from inference.spec.loading import spec_problems

    spec = dataclasses.replace(tiny.SPEC, train_epochs=0, train_batch_size=-1)
    assert spec_problems(spec) == [
        "train_epochs 0 is not a positive whole number",
        "train_batch_size -1 is not a positive whole number",
    ]


def _spec(**changes: Any) -> ModelSpec:
    return dataclasses.replace(tiny.SPEC, **changes)


def _with_field(field: object, at: int | None = None) -> ModelSpec:
    """tiny.SPEC with `field` in place of its field `at` (reading_id, sensor_id, level, colour,
    taken_at), or after them."""
    fields = list[object](tiny.SPEC.fields)
    if at is None:
        fields.append(field)
    else:
        fields[at] = field
    return _spec(fields=tuple(fields))


HOOK = "a function returning the timeline columns (the function, not its result)"
BUILDER = "model must be a function or class building the nn.Module from a config (not a module)"


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (_spec(history_length="8"), "history_length must be an int, got '8'"),
        (_spec(history_length=2.5), "history_length must be an int, got 2.5"),
        (_spec(history_length=True), "history_length must be an int, got True"),
        (_spec(train_batch_size=2.5), "train_batch_size must be an int, got 2.5"),
        (_with_field(RecordId(1), at=0), "fields[0].name must be a str, got 1"),  # type: ignore[arg-type]
        (
            _with_field("amount"),
            "fields must be a tuple of RecordId, EntityKey, EventTime, Numeric and Categorical; fields[5] is 'amount'",
        ),
        (
            _with_field(Label("level"), at=2),
            "fields must be a tuple of RecordId, EntityKey, EventTime, Numeric and Categorical; fields[2] is a Label",
        ),
        (
            _with_field(Categorical("colour", vocabulary="abc"), at=3),  # type: ignore[arg-type]
            "fields[3].vocabulary must be a tuple of str, got 'abc'",
        ),
        (
            _with_field(Categorical("colour", vocabulary=["red", "green"]), at=3),  # type: ignore[arg-type]
            "fields[3].vocabulary must be a tuple of str, got a list",
        ),
        (
            _with_field(Numeric("level", minimum="0"), at=2),  # type: ignore[arg-type]
            "fields[2].minimum must be a number or None, got '0'",
        ),
        (_spec(encode=None), f"encode must be {HOOK}, got None"),
        (_spec(encode=tiny.encode()), f"encode must be {HOOK}, got a dict"),
        (
            _spec(features="nope"),
            "features must be a function of the timeline returning the model's inputs, got 'nope'",
        ),
        (_spec(model=3), f"{BUILDER}, got 3"),
        (_spec(model=tiny.TinyModel({"history_length": 2})), f"{BUILDER}, got a TinyModel"),
        (
            _spec(example=None),
            "example must be a function returning a valid record (the function, not the record), got None",
        ),
        (_spec(label="level"), "label must be a Label or None, got 'level'"),
        (
            _spec(rules=(RecordRule("odd", "level", tiny.SPEC.rules[0].refuses()),)),  # type: ignore[arg-type]
            "rules[0].refuses must be a function returning a polars expression, got an Expr",
        ),
    ],
    ids=lambda value: "" if isinstance(value, ModelSpec) else value[:40],
)
def test_a_wrongly_typed_attribute_is_named_with_what_it_must_be(
    module: types.ModuleType, spec: ModelSpec, said: str
) -> None:
    assert refusal(module, spec) == said
