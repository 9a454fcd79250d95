"""Settings an asset or check reads each time it runs. They live here, not in
orchestration/settings.py, because assets never import orchestration/; its sensors read them here."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class DeadlineSettings(BaseSettings):
    """When a day's batch predictions are due: read each time the deadline sensor or check
    evaluates, so a new deadline needs a restart of the code location, not a deploy."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    predictions_deadline_utc: time = Field(
        default=time(8, 0), description="time of day (UTC, HH:MM) by which a day's predictions are due"
    )
    predictions_deadline_days_after: int = Field(
        default=1, ge=1, le=7, description="on which day after the partition: 1 = the next day"
    )
    deadline_lookback_days: int = Field(
        default=7,
        ge=1,
        le=90,
        description="the deadline sensor judges the days due in this many days back, so a daemon that was down "
        "still reports each day it missed; older days are never judged",
    )

    # A wall-clock time in another zone would move with daylight saving; the deadline is UTC.
    @field_validator("predictions_deadline_utc")
    @classmethod
    def _utc(cls, value: time) -> time:
        offset = value.utcoffset()
        if offset is not None and offset != timedelta(0):
            raise ValueError("the deadline is a UTC time of day: give it without an offset")
        return value.replace(tzinfo=None)

    def due(self, day: date) -> datetime:
        """When the predictions of `day` are due."""
        return datetime.combine(
            day + timedelta(days=self.predictions_deadline_days_after), self.predictions_deadline_utc, UTC
        )

    def last_due_day(self, now: datetime) -> date:
        """The latest day whose deadline is at or before `now`."""
        day = now.astimezone(UTC).date() - timedelta(days=self.predictions_deadline_days_after)
        return day if self.due(day) <= now else day - timedelta(days=1)
