"""Tandem's shared core: records, features, model, contract and store.

This package is the single implementation of the business logic. It imports neither dagster nor
bentoml (enforced by import-linter), so the batch path and the online path cannot drift apart.
"""
