"""Prefect's side of the rehearsal (bench/rehearsal.py): what the run left in its database, and how long the UI takes
to show it.

`figures` reads the database read-only: rows of Prefect's own tables, flow runs by state, bytes. `page_loads` opens
two pages of the UI in a headless Chromium (Debian's /usr/bin/chromium, driven by Playwright; `make rehearsal-browser`
installs both) and times each until its content is on screen: the flow run with the most log lines (its name and its
first log line shown: the logs tab lists them oldest first), and the artifacts page (the last artifact's key shown).
One cold load, then three warm ones in new browser contexts (the median). The API calls behind them are timed apart,
so that the server and the browser can be told apart. Nothing here is needed by the CI test: without Chromium the
pages are skipped and that is said.
"""

from __future__ import annotations

import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
# The flags a root user on a machine without network needs (/work/.library/env: without the background-networking
# ones, Chromium's calls home are refused by the dozen).
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WARM = 3


def figures(home: Path) -> dict[str, Any]:
    """Rows of Prefect's own tables (read-only), flow runs by state, and the database's bytes."""
    db = home / "prefect.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        tables = [r[0] for r in con.execute("select name from sqlite_master where type='table'")]
        rows = {t: con.execute(f'select count(*) from "{t}"').fetchone()[0] for t in tables}
        states = dict(con.execute("select state_type, count(*) from flow_run group by state_type").fetchall())
        busiest = con.execute(
            "select flow_run_id, count(*) from log where flow_run_id is not null group by flow_run_id "
            "order by 2 desc limit 1"
        ).fetchone()
    keep = ("flow_run", "task_run", "log", "artifact", "artifact_collection", "events", "event_resources")
    size = sum(f.stat().st_size for f in home.glob("prefect.db*"))
    return {
        "rows": {t: rows[t] for t in keep if t in rows},
        "flow_run_states": {str(k): v for k, v in states.items()},
        "db_mb": round(size / 2**20, 2),
        "busiest_flow_run": {"id": busiest[0], "log_lines": busiest[1]} if busiest else None,
    }


def api_times(url: str, flow_run_id: str) -> dict[str, float]:
    """Seconds of the API calls the two pages make: the flow run, its logs (the UI asks for 200 at a time), the
    artifacts."""
    out = {}
    with httpx.Client(base_url=url + "/api", timeout=60) as client:
        for name, call in (
            ("flow_run", lambda: client.get(f"/flow_runs/{flow_run_id}")),
            (
                "logs",
                lambda: client.post(
                    "/logs/filter",
                    json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200},
                ),
            ),
            ("artifacts", lambda: client.post("/artifacts/latest/filter", json={"limit": 200})),
        ):
            started = time.monotonic()
            call().raise_for_status()
            out[name] = round(time.monotonic() - started, 3)
    return out


def page_loads(url: str, flow_run_id: str) -> dict[str, Any]:
    """The two pages' load times in headless Chromium, or why they were not measured."""
    if not Path(CHROMIUM).is_file() or not _playwright():
        return {"skipped": f"no {CHROMIUM} or no playwright (make rehearsal-browser installs both)"}
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with httpx.Client(base_url=url + "/api", timeout=60) as client:
        run = client.get(f"/flow_runs/{flow_run_id}").json()
        # the first line, as the logs tab lists them (oldest first, 200 at a time): the last one of a run with more
        # lines is shown only on scrolling
        [first_log] = client.post(
            "/logs/filter",
            json={"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 1},
        ).json()
        [artifact] = client.post("/artifacts/latest/filter", json={"sort": "CREATED_DESC", "limit": 1}).json()
    pages = {
        "flow_run": (f"{url}/runs/flow-run/{flow_run_id}", [run["name"], first_log["message"].splitlines()[0][:60]]),
        "artifacts": (f"{url}/artifacts", [artifact["key"]]),
    }
    out: dict[str, Any] = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            for name, (address, texts) in pages.items():
                try:
                    times = [_load(browser, address, texts) for _ in range(1 + WARM)]
                except PlaywrightError as exc:  # one page not measured is a figure missing, not the run's figures
                    out[name] = {"error": f"{address}: {str(exc).splitlines()[0]} (waited for {texts})"}
                    continue
                out[name] = {"cold_s": round(times[0], 2), "warm_median_s": round(statistics.median(times[1:]), 2)}
        finally:
            browser.close()
    return out


def _load(browser: Any, address: str, texts: list[str]) -> float:
    """Seconds from asking for `address` in a new browser context until each of `texts` is on screen."""
    context = browser.new_context()
    try:
        page = context.new_page()
        started = time.monotonic()
        page.goto(address)
        for text in texts:
            page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=120_000)
        return time.monotonic() - started
    finally:
        context.close()


def _playwright() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return True
