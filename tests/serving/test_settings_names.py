"""A renamed serving setting is still read under the name deployments were configured with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.settings import ServingSettings


def test_the_request_limit_is_read_under_its_name_and_its_older_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SERVING_MAX_TRANSACTIONS_PER_REQUEST", "7")
    assert ServingSettings().max_records_per_request == 7
    monkeypatch.setenv("TANDEM_SERVING_MAX_RECORDS_PER_REQUEST", "9")
    assert ServingSettings().max_records_per_request == 9  # the current name wins over the older one
    assert ServingSettings(max_records_per_request=3).max_records_per_request == 3


def test_a_request_limit_below_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_SERVING_MAX_RECORDS_PER_REQUEST", "0")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ServingSettings()
