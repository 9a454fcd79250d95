"""Settings the Dagster code location needs when its definitions load, and the `make run` launcher's."""

from __future__ import annotations

from datetime import date
from typing import Annotated

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.settings import HistoryLength, spec_history_length


class OrchestrationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore", populate_by_name=True)

    # A date, aliased: "yesterday" failed deep in Dagster's strptime, naming neither value nor variable.
    partitions_start: date = Field(
        default=date(2026, 11, 1), validation_alias="TANDEM_PARTITIONS_START", description="first daily partition (UTC)"
    )
    schedule_hour_utc: int = Field(default=2, ge=0, le=23)
    schedule_minute: int = Field(default=0, ge=0, le=59)
    # For training only (the spec's model asset).
    history_length: HistoryLength = Field(default_factory=spec_history_length, validate_default=True)


Port = Annotated[int, Field(ge=1, le=65_535)]


class PlatformSettings(BaseSettings):
    """Where `make run` (orchestration/platform.py) serves the Dagster UI and the scoring service."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    dagster_port: Port = 3000
    service_port: Port = 3001
    host: str = Field(default="127.0.0.1", description="both bind here; loopback unless told otherwise")
