"""Replacing one of uvicorn's defaults by name, as BentoML's worker leaves them ("auto").

BentoML builds uvicorn's `Config` itself, so the only way in is uvicorn's tables of named
implementations. The entry is replaced only where it is still uvicorn's own (or already ours), so
that an upgrade that moves it fails the service's start instead of quietly dropping the change.
"""

from __future__ import annotations

from uvicorn import config as uvicorn_config


def replace_auto(table: str, stock: str, ours: str, written_for: str) -> None:
    """Point `uvicorn.config.<table>["auto"]` at `ours` ("module:attribute") where it is `stock`.
    Idempotent. Raises RuntimeError otherwise, naming `written_for` (the module that needs it)."""
    entries = getattr(uvicorn_config, table, None)
    if not isinstance(entries, dict) or entries.get("auto") not in (stock, ours):
        raise RuntimeError(
            f"uvicorn's {table} has no stock 'auto' entry to replace; {written_for} was written against uvicorn 0.55"
        )
    entries["auto"] = ours
