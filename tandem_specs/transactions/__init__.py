"""The reference spec: payment transactions scored for fraud risk, with each account's history.

`TANDEM_MODEL_SPEC=tandem_specs.transactions:SPEC` (the default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from torch import nn

from inference.spec import Categorical, EntityKey, EventTime, Label, ModelSpec, Numeric, RecordId
from tandem_specs.transactions.demo import demo
from tandem_specs.transactions.features import encode, features
from tandem_specs.transactions.model import ModelConfig, RiskModel, mask_to_unknown
from tandem_specs.transactions.records import (
    CATEGORY_MAX_LENGTH,
    CATEGORY_PATTERN,
    COUNTRIES,
    COUNTRY_PATTERN,
    CURRENCIES,
    CURRENCY_PATTERN,
    MAX_PLAUSIBLE_AMOUNT,
    MERCHANT_CATEGORIES,
    REASON_ORDER,
)


def _model(config: Mapping[str, Any]) -> nn.Module:
    return RiskModel(ModelConfig(**config))


def _model_config(history_length: int) -> dict[str, Any]:
    return asdict(ModelConfig(history_length=history_length))


def _example() -> dict[str, Any]:
    return {
        "transaction_id": "demo-1",
        "account_id": "acct-000042",
        "amount": 42.5,
        "currency": "USD",
        "merchant_category": "grocery",
        "country": "US",
        "event_time": "2026-11-08T09:30:00Z",
    }


SPEC = ModelSpec(
    name="transactions",
    model_name="risk_model",
    version="1",
    fields=(
        RecordId("transaction_id"),
        EntityKey("account_id"),
        Numeric("amount", minimum=0.0, maximum=MAX_PLAUSIBLE_AMOUNT, below="amount_negative", above="amount_absurd"),
        Categorical(
            "currency",
            vocabulary=CURRENCIES,
            pattern=CURRENCY_PATTERN,
            min_length=3,
            max_length=3,
            malformed="bad_currency",
        ),
        Categorical(
            "merchant_category",
            vocabulary=MERCHANT_CATEGORIES,
            pattern=CATEGORY_PATTERN,
            max_length=CATEGORY_MAX_LENGTH,
            malformed="malformed_category",
        ),
        Categorical("country", vocabulary=COUNTRIES, pattern=COUNTRY_PATTERN, min_length=2, max_length=2),
        EventTime("event_time"),
    ),
    history_length=16,
    encode=encode,
    features=features,
    model=_model,
    model_config=_model_config,
    example=_example,
    label=Label("label_fraud"),
    augment_training=mask_to_unknown,
    demo=demo,
    plural="transactions",
    record_name="Transaction",
    reason_order=REASON_ORDER,
    title="Tandem risk scorer",
    score_description="Fraud probability in [0, 1].",
    description="Scores payment transactions for fraud risk, reading each account's recent history.",
)
