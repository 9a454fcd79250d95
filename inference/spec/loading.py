"""Load a spec by its import path, check it once, and refuse a bad one in one line."""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, get_args, get_origin

from pydantic import StringConstraints, TypeAdapter, ValidationError
from pydantic_core import SchemaError
from pydantic_settings import BaseSettings, SettingsConfigDict
from torch import nn

from inference.spec.fields import (
    Categorical,
    EntityKey,
    EventTime,
    Field,
    GenericReason,
    Label,
    Numeric,
    RecordId,
    RecordRule,
)
from inference.spec.model_spec import ModelSpec

DEFAULT_SPEC_PATH = "tandem_specs.transactions:SPEC"
# Columns the core adds beside a spec's fields (the record table, results, lineage).
RESERVED_COLUMNS = frozenset(
    {"event_ts", "partition_date", "reject_reason", "input_hash", "ingested_at", "record_id", "score"}
)
RESERVED_PREFIXES = ("previous_", "received_")
# Names become SQL columns, polars columns and JSON keys unquoted: lower-case identifiers only.
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,40}")
# The longest history a model may read (the history digest has one weight per lag).
MAX_HISTORY_LENGTH = 256


class SpecError(ValueError):
    """A spec that cannot be loaded or is not valid: one line, naming the path it was loaded by."""


# eq=False: hashed and compared by identity (load_spec returns one per path), so caching a
# function of it costs a pointer, not a walk over the whole spec, on every online batch.
@dataclass(frozen=True, eq=False)
class LoadedSpec:
    """A checked spec, with its role fields found once."""

    path: str
    spec: ModelSpec
    digest: str

    @property
    def id(self) -> RecordId:
        return next(f for f in self.spec.fields if isinstance(f, RecordId))

    @property
    def entity(self) -> EntityKey | None:
        return next((f for f in self.spec.fields if isinstance(f, EntityKey)), None)

    @property
    def event_time(self) -> EventTime:
        return next(f for f in self.spec.fields if isinstance(f, EventTime))

    @property
    def numerics(self) -> tuple[Numeric, ...]:
        return tuple(f for f in self.spec.fields if isinstance(f, Numeric))

    @property
    def categoricals(self) -> tuple[Categorical, ...]:
        return tuple(f for f in self.spec.fields if isinstance(f, Categorical))

    def numeric(self, name: str) -> Numeric:
        return next(f for f in self.numerics if f.name == name)

    def categorical(self, name: str) -> Categorical:
        return next(f for f in self.categoricals if f.name == name)

    @property
    def label(self) -> Label | None:
        return self.spec.label

    @property
    def table(self) -> str:
        return self.spec.table or self.spec.name

    def history_entity(self, history_length: int) -> str | None:
        """The field whose earlier records a model at K = `history_length` reads as history; None
        when it reads none (no entity, or K = 0). The one rule both paths, the store and the
        sensors ask."""
        return self.entity.name if self.entity is not None and history_length > 0 else None

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.spec.fields)


def role_of(field: Field) -> str:
    """The role's name as docs and `tandem spec` print it."""
    return {
        RecordId: "record id",
        EntityKey: "entity key",
        EventTime: "event time",
        Numeric: "numeric",
        Categorical: "categorical",
    }[type(field)]


def _vocabulary(field: Field) -> list[str] | None:
    return list(field.vocabulary) if isinstance(field, Categorical) else None


def schema_digest(spec: ModelSpec) -> str:
    """16 hex digits of what decides what a model's input means: the version, each field's role,
    name and vocabulary in order, and the label. Bounds, patterns and rules decide which records
    are scored, not what a score means, so they are left out; K is each model version's own."""
    canonical = {
        "version": spec.version,
        "fields": [
            [role_of(f), f.name, list(f.vocabulary) if isinstance(f, Categorical) else None] for f in spec.fields
        ],
        "label": spec.label.name if spec.label else None,
        "entity": any(isinstance(f, EntityKey) for f in spec.fields),
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_spec(path: str = DEFAULT_SPEC_PATH) -> LoadedSpec:
    """Import `package.module:attribute`, check the spec it names, and cache the result: one
    `LoadedSpec` per path, however it is asked for (what is built from it is cached by identity)."""
    return _load_spec(path)


@functools.cache
def _load_spec(path: str) -> LoadedSpec:
    try:
        spec = _import(path)
        problems = spec_problems(spec)
    except SpecError as error:
        raise SpecError(f"spec {path!r}: {error}") from None
    if problems:
        raise SpecError(f"spec {path!r}: " + "; ".join(problems))
    return LoadedSpec(path=path, spec=spec, digest=schema_digest(spec))


# As on any cached function: tests that rewrite a spec's module load it afresh.
load_spec.cache_clear = _load_spec.cache_clear  # type: ignore[attr-defined]


class SpecSettings(BaseSettings):
    """Which spec Tandem runs. Read here, not in inference.settings: the spec package is what a
    spec author imports, and must not pull in the platform's settings."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    model_spec: str = DEFAULT_SPEC_PATH


def configured_spec() -> LoadedSpec:
    """The spec Tandem runs, named by TANDEM_MODEL_SPEC: every entry point (Dagster resources,
    the service, the CLI, the scoring process's config) asks here."""
    path = SpecSettings().model_spec
    try:
        return load_spec(path)
    except SpecError as error:
        raise SpecError(f"TANDEM_MODEL_SPEC: {error}") from None


def _import(path: str) -> ModelSpec:
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise SpecError("expected package.module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        hint = "is its package installed or on PYTHONPATH?"
        raise SpecError(f"cannot import {module_name!r} ({error}; {hint})") from None
    except Exception as error:  # noqa: BLE001 - any failure of a team's module on import is its spec's problem
        raise SpecError(f"cannot import {module_name!r} ({type(error).__name__}: {error})") from None
    if not hasattr(module, attribute):
        raise SpecError(f"module {module_name!r} has no attribute {attribute!r}")
    spec = getattr(module, attribute)
    if not isinstance(spec, ModelSpec):
        raise SpecError(f"{attribute} is a {type(spec).__name__}, not an inference.spec.ModelSpec")
    return spec


# What each attribute of a spec and of its parts must be: (attribute, type, what a refusal says).
# A type is a class, `X | None` or `tuple[X, ...]`; a `Callable` is a hook, which the core calls
# when it needs it, so the function or class itself and never what it returns.
_ATTRIBUTE_TYPES: dict[type, tuple[tuple[str, Any, str], ...]] = {
    ModelSpec: (
        ("name", str, "a str"),
        ("model_name", str, "a str"),
        ("version", str, "a str"),
        ("fields", tuple[Field, ...], "a tuple of RecordId, EntityKey, EventTime, Numeric and Categorical"),
        ("history_length", int, "an int"),
        ("encode", Callable, "a function returning the timeline columns (the function, not its result)"),
        ("features", Callable, "a function of the timeline returning the model's inputs"),
        ("model", Callable, "a function or class building the nn.Module from a config (not a module)"),
        ("model_config", Callable, "a function of K returning a model config"),
        ("example", Callable, "a function returning a valid record (the function, not the record)"),
        ("label", Label | None, "a Label or None"),
        ("augment_training", Callable | None, "a function of (arrays, seed) or None"),
        ("train_epochs", int, "an int"),
        ("train_batch_size", int, "an int"),
        ("table", str | None, "a str or None"),
        ("plural", str, "a str"),
        ("record_name", str, "a str"),
        ("rules", tuple[RecordRule, ...], "a tuple of RecordRule"),
        ("reason_order", tuple[str, ...] | None, "a tuple of str or None"),
        ("demo", Callable | None, "a function of (spec, day, settings) or None"),
        ("title", str, "a str"),
        ("description", str, "a str"),
        ("score_description", str, "a str"),
    ),
    RecordId: (("name", str, "a str"), ("max_length", int, "an int")),
    EntityKey: (("name", str, "a str"), ("max_length", int, "an int")),
    EventTime: (("name", str, "a str"),),
    Numeric: (
        ("name", str, "a str"),
        ("minimum", int | float | None, "a number or None"),
        ("maximum", int | float | None, "a number or None"),
        ("below", str | None, "a str or None"),
        ("above", str | None, "a str or None"),
    ),
    Categorical: (
        ("name", str, "a str"),
        ("vocabulary", tuple[str, ...], "a tuple of str"),
        ("pattern", str, "a str"),
        ("max_length", int, "an int"),
        ("min_length", int, "an int"),
        ("malformed", str | None, "a str or None"),
    ),
    Label: (("name", str, "a str"),),
    RecordRule: (
        ("code", str, "a str"),
        ("field", str, "a str"),
        ("refuses", Callable, "a function returning a polars expression"),
    ),
}


def spec_problems(spec: ModelSpec) -> list[str]:
    """Every reason the spec cannot run, in declaration order (empty: it can)."""
    # The checks below read values as their declared types (a str history_length cannot be
    # compared, an int name matched): a spec with a wrongly typed attribute is refused for its types.
    problems = _type_problems("", spec)
    if problems:
        return problems
    named = [("name", spec.name), ("model_name", spec.model_name), ("plural", spec.plural), ("table", spec.table)]
    problems = [
        _not_a_name(what, name) for what, name in named if name is not None and not NAME_PATTERN.fullmatch(name)
    ]
    fields: list[Field | Label] = [*spec.fields, *([spec.label] if spec.label else [])]
    seen: set[str] = set()
    for field in fields:
        if not NAME_PATTERN.fullmatch(field.name):
            problems.append(_not_a_name("field", field.name))
        if field.name in RESERVED_COLUMNS or field.name.startswith(RESERVED_PREFIXES):
            problems.append(f"field {field.name!r} is a reserved column")
        if field.name in seen:
            problems.append(f"two fields named {field.name!r}")
        seen.add(field.name)
        if isinstance(field, Categorical):
            problems.extend(_vocabulary_problems(field))
    for role, count in _role_counts(spec.fields).items():
        if count != 1:
            problems.append(f"needs exactly one {role.__name__}, has {count}")
    entities = sum(isinstance(f, EntityKey) for f in spec.fields)
    if entities > 1:
        problems.append(f"at most one EntityKey, has {entities}")
    if not 0 <= spec.history_length <= MAX_HISTORY_LENGTH:
        problems.append(f"history_length {spec.history_length} outside 0..{MAX_HISTORY_LENGTH}")
    elif spec.history_length and not entities:
        problems.append(f"history_length {spec.history_length} needs an EntityKey")
    problems += [
        f"{name} {value} is not a positive whole number"
        for name, value in (("train_epochs", spec.train_epochs), ("train_batch_size", spec.train_batch_size))
        if value < 1
    ]
    problems.extend(_code_problems(spec))
    try:
        # The core keeps what it builds from a spec (expressions, schemas, the record model) per
        # loaded spec, keyed by its value.
        hash(spec)
    except TypeError as error:
        problems.append(f"is not hashable ({error}): give its hooks as functions or classes")
    return problems


def _type_problems(where: str, owner: object) -> list[str]:
    """Each attribute of `owner` (the spec, a field, a rule) that is not of its type in
    `_ATTRIBUTE_TYPES`, named by its path from the spec (`fields[3].vocabulary`)."""
    rows = next((rows for kind, rows in _ATTRIBUTE_TYPES.items() if isinstance(owner, kind)), ())
    problems = []
    for attribute, expected, description in rows:
        value, name = getattr(owner, attribute), f"{where}{attribute}"
        if not _conforms(value, expected):
            problems.append(_type_refusal(name, value, expected, description))
        elif isinstance(value, tuple):
            for index, item in enumerate(value):
                problems += _type_problems(f"{name}[{index}].", item)
        else:
            problems += _type_problems(f"{name}.", value)
    return problems


def _options(expected: Any) -> tuple[Any, ...]:
    return get_args(expected) if isinstance(expected, UnionType) else (expected,)


def _conforms(value: object, expected: Any) -> bool:
    # bool is an int and a module instance is callable, yet neither is what any attribute means.
    if isinstance(value, (bool, nn.Module)):
        return False
    return any(
        isinstance(value, tuple) and all(_conforms(item, get_args(option)[0]) for item in value)
        if get_origin(option) is tuple
        else isinstance(value, option)
        for option in _options(expected)
    )


def _type_refusal(name: str, value: object, expected: Any, description: str) -> str:
    """`name must be <description>, got <value>`; in a tuple, the first item that is not."""
    items = [get_args(option)[0] for option in _options(expected) if get_origin(option) is tuple]
    if items and isinstance(value, tuple):
        index, item = next((i, item) for i, item in enumerate(value) if not _conforms(item, items[0]))
        return f"{name} must be {description}; {name}[{index}] is {_shown(item)}"
    return f"{name} must be {description}, got {_shown(value)}"


def _shown(value: object) -> str:
    """A value as a refusal names it, on one line: a short scalar as written, anything else by
    its type (a module's or a mapping's repr spans lines and pages)."""
    if isinstance(value, (str, int, float, type(None))):
        return reprlib.repr(value)
    if isinstance(value, type):
        return f"the class {value.__name__}"
    kind = type(value).__name__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def _not_a_name(what: str, name: str) -> str:
    return f"{what} {name!r} is not a lower-case name (letters, digits and _, at most 41)"


def _role_counts(fields: tuple[Field, ...]) -> dict[type, int]:
    return {role: sum(isinstance(f, role) for f in fields) for role in (RecordId, EventTime)}


def _vocabulary_problems(field: Categorical) -> list[str]:
    problems = []
    if not 1 <= field.min_length <= field.max_length:
        problems.append(f"categorical {field.name!r} needs 1 <= min_length <= max_length")
    if not field.vocabulary:
        problems.append(f"categorical {field.name!r} has an empty vocabulary")
    if len(set(field.vocabulary)) != len(field.vocabulary):
        problems.append(f"vocabulary of {field.name!r} repeats a value")
    try:
        # Checked by pydantic's Rust regex engine, polars' own: the record model and `validate`
        # read the pattern alike. Not by polars itself: a spec is loaded while modules import,
        # and a polars computation there starts its thread pool, which a process forked from
        # the importer (the scoring process, from its fork server) inherits without threads.
        well_formed = TypeAdapter(Annotated[str, StringConstraints(pattern=field.pattern)])
    except SchemaError as error:
        return [*problems, f"pattern of {field.name!r} is no regular expression ({str(error).splitlines()[-1]})"]
    matches = [_matches(well_formed, value) for value in field.vocabulary]
    problems += [
        f"vocabulary value {value!r} of {field.name!r} does not match its pattern"
        for value, matched in zip(field.vocabulary, matches, strict=True)
        if not matched
    ]
    return problems


def _matches(well_formed: TypeAdapter[str], value: str) -> bool:
    try:
        well_formed.validate_python(value)
    except ValidationError:
        return False
    return True


def reason_codes(spec: ModelSpec) -> list[str]:
    """Every reason code the spec's fields and rules give, in field order, then the rules'."""
    codes = []
    for field in spec.fields:
        if isinstance(field, Numeric):
            codes += [field.unparsable_code, field.not_finite_code]
            codes += [field.below_code] if field.minimum is not None else []
            codes += [field.above_code] if field.maximum is not None else []
        elif isinstance(field, Categorical):
            codes.append(field.malformed_code)
    return codes + [rule.code for rule in spec.rules]


GENERIC_REASONS: tuple[str, ...] = tuple(reason.value for reason in GenericReason)
# Scoring's codes: no record is refused for them by validation, so no order ranks them.
SCORING_REASONS = frozenset({GenericReason.MODEL_ERROR.value, GenericReason.NONFINITE_SCORE.value})


def validation_order(spec: ModelSpec) -> tuple[str, ...]:
    """The codes validation checks, in order: `spec.reason_order`, or by default the generic
    checks, each field's codes in field order, the spec's rules, then the timestamps."""
    if spec.reason_order is not None:
        return tuple(code for code in spec.reason_order if code not in SCORING_REASONS)
    head = (GenericReason.NUL_CHARACTER, GenericReason.MISSING_FIELD, GenericReason.DUPLICATE_ID)
    tail = (GenericReason.TIMESTAMP_MISSING, GenericReason.TIMESTAMP_UNPARSABLE)
    return (*(r.value for r in head), *reason_codes(spec), *(r.value for r in tail))


def _code_problems(spec: ModelSpec) -> list[str]:
    problems = []
    codes = reason_codes(spec)
    seen: set[str] = set(GENERIC_REASONS)
    for code in codes:
        if not NAME_PATTERN.fullmatch(code):
            problems.append(_not_a_name("reason code", code))
        if code in seen:
            problems.append(f"reason code {code!r} twice")
        seen.add(code)
    names = {f.name for f in spec.fields}
    problems += [f"rule {r.code!r} names no field {r.field!r}" for r in spec.rules if r.field not in names]
    if spec.reason_order is not None:
        known = set(GENERIC_REASONS) | set(codes)
        problems += [f"reason_order names no reason {code!r}" for code in spec.reason_order if code not in known]
        missing = sorted(known - set(spec.reason_order) - SCORING_REASONS)
        if missing:
            problems.append(f"reason_order leaves out {', '.join(missing)}")
    return problems
