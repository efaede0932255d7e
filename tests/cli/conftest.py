"""Every flow test of the session runs against the worker's one Prefect test server (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _flows_use_the_harness(prefect_harness):
    """Autouse here: a flow called in-process without a server would start a temporary one of its own."""
    yield
