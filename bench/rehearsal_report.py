"""The rehearsal's tables (bench/rehearsal.py): one run's, or several sizes' merged with the growth of each cost.

    .venv/bin/python bench/rehearsal_report.py --merge s001.json s01.json s1.json [--markdown]

The slope between two sizes is ln(y2 / y1) / ln(t2 / t1), y a cost and t the tokens of the stage: 1 grows with the
work, 0 is fixed, above 1.1 grows faster than the work (a defect to find). Fixed start-up costs pull slopes below 1,
so the marginal cost, (y2 - y1) / (t2 - t1) per 1M tokens, is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402

STAGES = ("generate", "records", "plan", "capture", "train")


def stage_tokens(out: dict[str, Any], stage: str) -> int:
    """What a stage's cost is counted against: completion tokens for generate, record tokens after it."""
    return out["tokens"]["completion"] if stage == "generate" else out["tokens"]["tokens"]


def stage_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage: wall (all its runs), our CPU, CPU per 1M tokens, the largest peak RSS of each kind."""
    rows = []
    for stage in STAGES:
        runs = out[stage]["runs"]
        cost = out["processes"].get(stage, {})
        tokens = stage_tokens(out, stage)
        rows.append(
            {
                "stage": stage,
                "runs": len(runs),
                "killed": sum(1 for r in runs if r["killed_at"]),
                "wall_s": round(sum(r["wall_s"] for r in runs), 1),
                "cpu_s": cost.get("cpu_s", 0.0),
                "cpu_s_per_1m": round(cost.get("cpu_s", 0.0) / max(tokens, 1) * 1e6, 2),
                "tokens": tokens,
                "peak_rss_mb": cost.get("peak_rss_mb", {}),
            }
        )
    return rows


def stats_latency(out: dict[str, Any]) -> dict[str, Any]:
    calls = out["generate"]["stats"]
    walls = sorted(c["wall_s"] for c in calls)
    if not walls:
        return {"calls": 0}
    return {
        "calls": len(walls),
        "failed": sum(1 for c in calls if c["rc"] != 0),
        "p50_s": walls[len(walls) // 2],
        "p95_s": walls[min(len(walls) - 1, math.ceil(0.95 * len(walls)) - 1)],
        "max_s": walls[-1],
        "max_rss_mb": max(c.get("peak_rss_mb", 0) for c in calls),
        "max_parts": max((c["parts"] or 0) for c in calls),
    }


def print_report(out: dict[str, Any]) -> None:
    size = out["params"]["size"]
    print(
        f"\nThe rehearsal at {size:g} of the reference ({out['tokens']['completion']:,} completion tokens, "
        f"{out['tokens']['records']:,} records of {out['tokens']['tokens']:,} tokens)"
    )
    harness.table(
        ["stage", "runs", "killed", "wall s", "our CPU s", "CPU s / 1M tok", "peak RSS MB by process"],
        [
            [
                r["stage"],
                r["runs"],
                r["killed"],
                r["wall_s"],
                r["cpu_s"],
                r["cpu_s_per_1m"],
                ", ".join(f"{k} {v:g}" for k, v in r["peak_rss_mb"].items()),
            ]
            for r in stage_rows(out)
        ],
    )
    for role in ("sim", "prefect"):
        cost = out["processes"].get(role, {})
        print(f"  {role}: CPU {cost.get('cpu_s', 0)} s, peak RSS {cost.get('peak_rss_mb', {})} MB")
    lat = stats_latency(out)
    print(f"\n`eagle3 stats` while generate wrote: {lat}")
    print("\ngenerate per set:")
    harness.table(
        ["set", "rows", "distinct", "rejects", "answers", "tokens", "budget", "complete", "ok"],
        [[name, *c.values()] for name, c in out["generate"]["checks"].items()],
    )
    for run in out["generate"]["runs"]:
        if run["killed_at"]:
            k = run["killed_at"]
            print(
                f"  killed after {k['after_s']} s: the engine had served {k['served_tokens']:,} tokens, "
                f"{k['on_disk_tokens']:,} were on disk"
            )
    engine = out["generate"]["sim"]
    shown = ("served_tokens", "aborted_tokens", "duplicate_rids", "completed", "aborted")
    print(f"  the engine: {json.dumps({k: engine[k] for k in shown})}")
    print(f"\nlater stages: {out['checks']}")
    print(f"disk: {out['disk']}")
    print(f"Prefect: {out['prefect']}")
    print(f"Prefect's API (s): {out.get('prefect_api_s')}; its UI in headless Chromium: {out.get('prefect_pages')}")


def slope(y1: float, y2: float, t1: float, t2: float) -> float | None:
    if min(y1, y2, t1, t2) <= 0 or t1 == t2:
        return None
    return round(math.log(y2 / y1) / math.log(t2 / t1), 2)


def merge(outs: list[dict[str, Any]], markdown: bool) -> None:
    """One table per stage across sizes, and the slopes from each size to the next."""
    outs = sorted(outs, key=lambda o: o["params"]["size"])
    show = harness.markdown_table if markdown else harness.table
    for stage in STAGES:
        rows = []
        for k, out in enumerate(outs):
            r = next(x for x in stage_rows(out) if x["stage"] == stage)
            rss = max(r["peak_rss_mb"].values(), default=0.0)
            row = [f"{out['params']['size']:g}", f"{r['tokens']:,}", r["wall_s"], r["cpu_s"], r["cpu_s_per_1m"], rss]
            if k:
                prev = outs[k - 1]
                p = next(x for x in stage_rows(prev) if x["stage"] == stage)
                prss = max(p["peak_rss_mb"].values(), default=0.0)
                dt = (r["tokens"] - p["tokens"]) / 1e6
                row += [
                    slope(p["wall_s"], r["wall_s"], p["tokens"], r["tokens"]),
                    slope(p["cpu_s"], r["cpu_s"], p["tokens"], r["tokens"]),
                    slope(prss, rss, p["tokens"], r["tokens"]),
                    round((r["cpu_s"] - p["cpu_s"]) / dt, 2) if dt > 0 else None,
                ]
            else:
                row += ["", "", "", ""]
            rows.append(row)
        print(f"\n{stage}")
        show(
            [
                "size",
                "tokens",
                "wall s",
                "our CPU s",
                "CPU s / 1M",
                "peak RSS MB",
                "slope wall",
                "slope CPU",
                "slope RSS",
                "marginal CPU s / 1M",
            ],
            rows,
        )
    print("\n`eagle3 stats` while generate wrote")
    show(
        ["size", "calls", "failed", "p50 s", "p95 s", "max s", "max RSS MB", "parts at most"],
        [[f"{o['params']['size']:g}", *stats_latency(o).values()] for o in outs],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merge", nargs="+", type=Path, required=True, help="the JSON of each size (--json)")
    ap.add_argument("--markdown", action="store_true", help="tables as docs/ hold them")
    args = ap.parse_args()
    merge([json.loads(path.read_text()) for path in args.merge], args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
