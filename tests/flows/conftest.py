"""One Prefect test server for every flow test of the session (starting one takes ~10 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    import os

    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(home / "results")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def harness_api_url(prefect_harness) -> str:
    """The session's test server, for `eagle3` subprocesses that need not start a temporary one (~15 s on 2 cores)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url and url.startswith("http://127.0.0.1:"), url
    return url
