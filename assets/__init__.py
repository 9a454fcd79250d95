"""Dagster software-defined assets: thin adapters over `inference/` (the batch path)."""
