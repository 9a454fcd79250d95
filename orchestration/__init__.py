"""Dagster composition root: Definitions, resources, partitions, schedules, sensors."""
