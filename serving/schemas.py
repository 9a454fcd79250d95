"""The HTTP contract of /score: pydantic models that are also the BentoML API's input and output
specs (its /docs.json, docs page and clients), generated per spec by `api_models`;
serving/openapi.py builds the documents from them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import bentoml
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from inference.spec import LoadedSpec, load_spec
from inference.spec.api import RecordBase, a_number, record_model

DEADLINE_HEADER = "X-Deadline-Ms"
IDEMPOTENCY_HEADER = "Idempotency-Key"
REQUEST_ID_HEADER = "X-Request-ID"


class ItemError(BaseModel):
    reason: str = Field(description="A reject reason code (e.g. model_error, nonfinite_score).")
    detail: str | None = None


class ItemResult(BaseModel):
    """The base of every spec's item result (`api_models`): its fields are the spec's id field,
    then `_result_fields`, the same for every spec."""

    # The spec whose result this is: a generated class is no module attribute, so a result
    # crossing to or from the scoring process is pickled by the spec's path.
    spec_path: ClassVar[str] = ""
    id_name: ClassVar[str] = ""
    if TYPE_CHECKING:  # the fields exist at run time only, in `api_models`' classes
        status: Literal["scored", "error"]
        score: float | None
        model_version: str
        path: Literal["online", "batch"]
        request_id: str | None
        batch_id: str | None
        produced_at: datetime
        input_hash: str | None
        degraded: bool
        unseen_fields: list[str]
        error: ItemError | None

        def __init__(self, **values: Any) -> None: ...

    @classmethod
    def for_record(cls, record_id: str, **values: Any) -> ItemResult:
        return cls(**{cls.id_name: record_id}, **values)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_item_result, (self.spec_path, self.__getstate__()))


def _item_result(spec_path: str, state: dict[Any, Any]) -> ItemResult:
    result_model = api_models(load_spec(spec_path)).item_result
    result = result_model.__new__(result_model)
    result.__setstate__(state)
    return result


class ScoreRequestBase(bentoml.IODescriptor):
    model_config = ConfigDict(extra="forbid")

    # A JSON number, as the header and a record's numeric fields must be: read leniently, true
    # was 1 ms and "100" 100 ms.
    _deadline_a_number = pydantic.field_validator("deadline_ms", mode="before", check_fields=False)(a_number)


class ScoreResponseBase(bentoml.IODescriptor):
    request_id: str
    if TYPE_CHECKING:
        results: list[ItemResult]


@dataclass(frozen=True)
class ApiModels:
    """One spec's /score models: the record, the request, an item's result and the response."""

    record: type[RecordBase]
    request: type[ScoreRequestBase]
    item_result: type[ItemResult]
    response: type[ScoreResponseBase]
    results: pydantic.TypeAdapter[list[ItemResult]]


@functools.cache
def api_models(ls: LoadedSpec) -> ApiModels:
    """The request lists the spec's records under `spec.plural`; each result names its record by
    the spec's id field. Every other field, and every refusal, is the same for every spec."""
    record = record_model(ls)
    plural = ls.spec.plural
    records = Field(min_length=1, description=f"{plural.capitalize()} to score, in answer order.")
    request_fields: dict[str, Any] = {
        plural: (list[record], records),  # type: ignore[valid-type]
        "idempotency_key": (
            # Read without surrounding whitespace, as the header is (serving.gate._key_header).
            Annotated[str, pydantic.StringConstraints(strip_whitespace=True, min_length=1, max_length=200)] | None,
            Field(
                default=None,
                description="The Idempotency-Key header, for clients that cannot set headers (BentoML's); "
                "the header wins when both are sent and equal, and they must not differ.",
            ),
        ),
        "deadline_ms": (
            float | None,
            Field(
                default=None,
                gt=0,
                allow_inf_nan=False,  # refused as the header's "inf" is
                description="The X-Deadline-Ms header, for clients that cannot set headers.",
            ),
        ),
    }
    request = pydantic.create_model("ScoreRequest", __base__=ScoreRequestBase, __module__=__name__, **request_fields)
    result_fields: dict[str, Any] = {ls.id.name: (str, ...), **_result_fields(ls)}
    item_result = pydantic.create_model("ItemResult", __base__=ItemResult, __module__=__name__, **result_fields)
    item_result.spec_path = ls.path
    item_result.id_name = ls.id.name
    response: type[ScoreResponseBase] = pydantic.create_model(
        "ScoreResponse",
        __base__=ScoreResponseBase,
        __module__=__name__,
        results=(list[item_result], ...),  # type: ignore[valid-type]
    )
    return ApiModels(record, request, item_result, response, pydantic.TypeAdapter(list[item_result]))  # type: ignore[valid-type]


def _degraded_description(ls: LoadedSpec) -> str:
    if ls.entity is None:
        return "Always false: the model reads no stored history."
    # The words name the entity without its id suffix ("sensor history" for "sensor_id").
    owner = ls.entity.name.removesuffix("_id")
    return f"Scored without {owner} history: the database was down."


def _result_fields(ls: LoadedSpec) -> dict[str, Any]:
    categoricals = ", ".join(sorted(field.name for field in ls.categoricals))
    return {
        "status": (Literal["scored", "error"], ...),
        "score": (float | None, Field(default=None, description=ls.spec.score_description)),
        "model_version": (str, ...),
        "path": (
            Literal["online", "batch"],
            Field(description="Which path produced the answer (a stored batch row)."),
        ),
        "request_id": (
            str | None,
            Field(description="The request that produced the answer (lineage), maybe an earlier one."),
        ),
        "batch_id": (str | None, None),
        "produced_at": (datetime, ...),
        "input_hash": (str | None, None),
        "degraded": (bool, Field(default=False, description=_degraded_description(ls))),
        "unseen_fields": (
            list[str],
            Field(
                default_factory=list,
                description=f"Fields (sorted; among {categoricals}) whose value the model was not "
                "trained on: well-formed, so scored through the model's 'unknown' bucket, with less to go on.",
            ),
        ),
        "error": (ItemError | None, None),
    }


class ErrorBody(BaseModel):
    error: str
    detail: Any = None
