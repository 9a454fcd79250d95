"""Settings the Dagster code location needs when its definitions load."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.settings import HistoryLength


class OrchestrationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    partitions_start: str = Field(default="2026-11-01", description="first daily partition (UTC)")
    schedule_hour_utc: int = Field(default=2, ge=0, le=23)
    schedule_minute: int = Field(default=0, ge=0, le=59)
    history_length: HistoryLength = 16  # for training only (the risk_model asset)
