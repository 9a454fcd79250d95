"""The reference spec as tests read it: its loaded spec, raw columns, record model and vocabularies."""

from __future__ import annotations

from typing import Any

from inference.records import raw_columns, raw_schema
from inference.spec import load_spec
from inference.spec.api import record_model
from inference.store import record_table
from serving.schemas import api_models
from tandem_specs.transactions.records import COUNTRIES, CURRENCIES, MERCHANT_CATEGORIES

REFERENCE = load_spec()
RAW_COLUMNS = raw_columns(REFERENCE)
RAW_SCHEMA = raw_schema(REFERENCE)
ID_MAX_LENGTH = REFERENCE.id.max_length
# The reference's record table, `transactions`.
RECORDS = record_table(REFERENCE).table
# Any: its fields exist at run time only, as the spec declares them.
Transaction: Any = record_model(REFERENCE)
# The reference's item result: `transaction_id`, then the fields every spec's result has.
ItemResult: Any = api_models(REFERENCE).item_result

__all__ = [
    "COUNTRIES",
    "CURRENCIES",
    "ID_MAX_LENGTH",
    "MERCHANT_CATEGORIES",
    "RAW_COLUMNS",
    "RAW_SCHEMA",
    "RECORDS",
    "REFERENCE",
    "ItemResult",
    "Transaction",
]
