"""Fixtures for the shared core's tests (helpers that are not fixtures live in support.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def torch_single_thread() -> Iterator[None]:
    """Run torch on one thread for the test: results are reproducible per thread count anyway, and on a
    2-core machine shared with PostgreSQL, OpenMP threads spinning against each other make many small
    forward passes twenty times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
