"""Prefect flows: the pipeline and one flow per stage, the run config file (config/), the preflight and the plan."""

import os

# Machines that run the pipeline are often offline: do not let Prefect's local server try to
# send telemetry (it logs an error on every start when it cannot).
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The temporary server a flow run starts without PREFECT_API_URL needs more than the default
# 20 s on a busy 2-core machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
