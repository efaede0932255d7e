"""Flow runs whose process was killed: ended as Crashed when the next writer takes their run directory.

A process killed with SIGKILL (or on a machine that stopped) reports nothing to Prefect: its flow runs stay Running
in the UI for good, and a day-long run killed twice shows three "running" pipelines. The run lock knows better
(tasks/runtime/run_lock.py): a writer empties `.lock` when it releases it, so a holder left in the file by the time the
next writer takes the lock never released it, and the flow runs it wrote there (`flow_run_ids`) are dead. Those still
Running (or Pending) are set to Crashed, with a message naming the process; the others are left as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.runtime.run_lock import dead_holder, describe_holder

LIVE = ("RUNNING", "PENDING", "SCHEDULED")


def end_dead_runs(run_dir: Path | str, log: logging.Logger | logging.LoggerAdapter) -> list[str]:
    """Set the flow runs of RUN_DIR's dead lock holder, if any, to Crashed; the ids of those changed."""
    holder = dead_holder(run_dir)
    if not holder or not holder.get("flow_run_ids"):
        return []
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    message = (
        f"its process ended without reporting (killed, or its machine stopped): {describe_holder(holder)}; "
        f"found when {Path(run_dir)} was taken by the next writer"
    )
    ended: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            for run_id in holder["flow_run_ids"]:
                try:
                    run: Any = client.read_flow_run(UUID(run_id))
                except Exception:  # not on this Prefect server (another PREFECT_API_URL), or deleted
                    continue
                if run.state is None or run.state.type.value not in LIVE:
                    continue
                client.set_flow_run_state(UUID(run_id), Crashed(message=message), force=True)
                ended.append(run_id)
    except Exception as exc:  # never stop a run for its predecessor's bookkeeping
        log.warning("could not mark the flow runs of a killed run as Crashed: %s", exc)
        return ended
    if ended:
        log.warning("%d flow run(s) of a killed run marked Crashed (%s): %s", len(ended), ", ".join(ended), message)
    return ended
