"""Dagster composition root: Definitions, resources, partitions, schedules, sensors."""

from inference.homes import apply_default_homes
from orchestration.instance import ensure_checkout_instance

# Here, before the code location imports bentoml, which reads BENTOML_HOME once per process.
ensure_checkout_instance(apply_default_homes())
