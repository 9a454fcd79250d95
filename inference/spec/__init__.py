"""The model spec: the one interface through which a team's model runs on both paths.

A spec author imports from here only (docs/spec.md).
"""

from inference.spec.demo import POISON_REASON, DemoHook, DemoSettings, poison
from inference.spec.fields import (
    EVENT_TIME_PATTERN,
    ID_MAX_LENGTH,
    TEXT_PATTERN,
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
from inference.spec.loading import (
    DEFAULT_SPEC_PATH,
    GENERIC_REASONS,
    LoadedSpec,
    SpecError,
    configured_spec,
    load_spec,
    reason_codes,
    role_of,
    schema_digest,
    validation_order,
)
from inference.spec.model_spec import ModelSpec
from inference.spec.timeline import Timeline

__all__ = [
    "DEFAULT_SPEC_PATH",
    "EVENT_TIME_PATTERN",
    "GENERIC_REASONS",
    "ID_MAX_LENGTH",
    "POISON_REASON",
    "TEXT_PATTERN",
    "Categorical",
    "DemoHook",
    "DemoSettings",
    "EntityKey",
    "EventTime",
    "Field",
    "GenericReason",
    "Label",
    "LoadedSpec",
    "ModelSpec",
    "Numeric",
    "RecordId",
    "RecordRule",
    "SpecError",
    "Timeline",
    "configured_spec",
    "load_spec",
    "poison",
    "reason_codes",
    "role_of",
    "schema_digest",
    "validation_order",
]
