"""When Dagster reruns a partition by itself: the declarative rules, evaluated by
`scoring_automation_sensor` (orchestration/definitions.py).

Rules that need row-level knowledge stay custom sensors (orchestration/sensors.py): which later
partitions read a corrected record as history is in the tables, not in Dagster's events.
"""

from __future__ import annotations

from datetime import timedelta

from dagster import AssetKey, AssetSelection, AutomationCondition

PRODUCTION_MODEL = AssetKey("production_model")
CHALLENGER_MODEL = AssetKey("challenger_model")
# Written by the BentoML service, observed by shadow_predictions_observer (orchestration/sensors.py).
SHADOW_PREDICTIONS = AssetKey("shadow_predictions")


def rescore_after_promotion(days: int) -> AutomationCondition | None:
    """predictions: a day already scored within the last `days` days is rescored once after the
    production model moves (a new data version of `production_model`: risk_model, `tandem models
    promote` or `rollback`) or after predictions' own code version is bumped.

    A change marks the days scored at that moment and is remembered until their rescore is
    requested: a marked day with a run in progress (which loaded the old model) is rescored once
    that run is over. A day first scored after the change is not marked, its run used the new
    model; one whose first run was already going shows Unsynced and is left to the operator.
    `since` evaluates its operands on every partition, hence `~missing()` inside it too.
    """
    if days <= 0:
        return None  # in_latest_time_window(0) would mean the latest day, not none
    model_moved = (
        AutomationCondition.any_deps_match(AutomationCondition.newly_updated())
        .allow(AssetSelection.assets(PRODUCTION_MODEL))
        .with_label("production_model has a new version")
    )
    changed = ((model_moved | AutomationCondition.code_version_changed()) & ~AutomationCondition.missing()).since(
        (AutomationCondition.newly_requested() | AutomationCondition.initial_evaluation()).with_label("requested")
    )
    return (
        AutomationCondition.in_latest_time_window(timedelta(days=days))
        & ~AutomationCondition.missing()
        & changed.with_label("model or code changed since the last rescore")
        & ~AutomationCondition.in_progress()
    ).with_label(f"rescore the last {days} scored days after a promotion or a code change")


def follow_predictions() -> AutomationCondition:
    """path_agreement: recomputed for a day whenever that day's predictions change outside a run
    that computes it too (a rescore above, a UI materialization of predictions alone).

    `AutomationCondition.eager()` without its `in_latest_time_window()`: eager only ever looks at
    the latest day, and rescores rewrite older ones. Nor does it fill missing days: the nightly run
    computes each new day.
    """
    return (
        AutomationCondition.any_deps_updated().since_last_handled()
        & ~AutomationCondition.any_deps_missing()
        & ~AutomationCondition.any_deps_in_progress()
        & ~AutomationCondition.in_progress()
    ).with_label("after its day's predictions change")
