"""Shared fixtures: one warm kernel pool for the whole test session (real sandboxed ipykernels)."""

from __future__ import annotations

import pytest

from sandbox import Limits, SyncKernelPool


@pytest.fixture(scope="session")
def pool():
    """A real sandboxed kernel pool (strongest isolation available), with the `submit` tool defined."""
    with SyncKernelPool(size=2, limits=Limits(wall_s=5.0), tools=["submit"]) as p:
        yield p
