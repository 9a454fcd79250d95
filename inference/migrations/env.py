"""Alembic environment: runs against the connection handed in by `inference.migrate.upgrade`."""

from __future__ import annotations

from alembic import context

from inference.store import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through inference.migrate.upgrade(engine)")
context.configure(connection=connection, target_metadata=metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
