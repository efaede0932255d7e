"""The generate-stage bench's report: its targets (PASS / FAIL) and its tables, from the `out` a run built.

bench/generate.py measures and calls `print_report`; the tables go through bench/harness.py.
"""

from __future__ import annotations

from typing import Any

from bench import harness
from bench.generate_params import Params


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    if "throughput" in out:
        t = {w["client"][:3]: w for w in out["throughput"]}
        a, b = t["(a)"], t["(b)"]
        trials = out["budget"]["trials"]
        over = [x["overshoot_pct"] for x in trials]
        waste = [max(x["server_waste_pct"], x["report_waste_pct"]) for x in trials]
        found += [
            {
                "target": "1a generate_dataset >= 95% of capacity",
                "value": f"{100 * a['utilisation']:.1f}%",
                "pass": a["utilisation"] >= 0.95,
            },
            {
                "target": "1b batch+barrier measured lower than 1a",
                "value": f"{100 * b['utilisation']:.1f}% < {100 * a['utilisation']:.1f}%",
                "pass": b["utilisation"] < a["utilisation"],
            },
            {
                "target": f"2 budget reached, spent within +1% ({len(trials)} trials)",
                "value": " ".join(f"{x:+.2f}%" for x in over),
                "pass": all(x["status"] == "budget reached" for x in trials) and all(0 <= x <= 1.0 for x in over),
            },
            {
                "target": f"2 aborted-token waste <= 2% of budget ({len(trials)} trials)",
                "value": " ".join(f"{x:.2f}%" for x in waste),
                "pass": all(x <= 2.0 for x in waste),
            },
        ]
    if "pool" in out:
        for r in out["pool"]["runs"]:
            found.append(
                {
                    "target": f"5 {r['servers']} server(s): >= 95% of their summed capacity, every prompt",
                    "value": f"{100 * r['share']:.1f}%",
                    "pass": r["share"] >= 0.95 and r["complete"],
                }
            )
        k = out["pool_kill"]
        found.append(
            {
                "target": f"5 one of {k['servers']} servers killed: every prompt recorded exactly once",
                "value": f"{k['responses']:,} rows, {k['distinct_ids']:,} ids of {k['prompts']:,}",
                "pass": k["exactly_once"] and k["killed_after_tokens"] is not None,
            }
        )
    if "stats" in out:
        st = out["stats"]
        found += [
            {"target": "4 stats well under a second", "value": f"{st['ours_s']:.3f} s", "pass": st["ours_s"] < 0.5},
            {"target": "4 stats >= 50x faster than JSONL", "value": f"{st['ratio']:.0f}x", "pass": st["ratio"] >= 50},
        ]
    return found


def print_report(p: Params, out: dict[str, Any]) -> None:
    if "throughput" in out:
        print_server_part(p, out)
    if "stats" in out:
        print_checkpoint_part(p, out)
    if "pool" in out:
        print_pool_part(out)
    print()
    print("targets" + ("  (--quick: a smoke run; judge the targets on the default run)" if p.quick else ""))
    harness.table(
        ("target", "measured", "result"),
        [(t["target"], t["value"], "PASS" if t["pass"] else "FAIL") for t in out["targets"]],
    )


def print_server_part(p: Params, out: dict[str, Any]) -> None:
    ps = out["prompt_set"]
    print()
    print(
        f"server: max_running {p.max_running}, decode {p.decode_ms} ms/token -> capacity "
        f"{p.capacity_tok_s:,.0f} tok/s; lengths lognormal mean {p.mean_len:.0f} sigma {p.sigma}, "
        f"max_new_tokens {p.max_new_tokens}"
    )
    print(
        f"prompts: {ps['prompts']} (prompt tokens mean {ps['prompt_tokens_mean']:.0f}); completions mean "
        f"{ps['completion_tokens_mean']:.0f}, p50 {ps['completion_p50']}, p99 {ps['completion_p99']}, "
        f"max {ps['completion_max']} ({ps['hit_max_new_tokens']} cut at max_new_tokens)"
    )
    print()
    print("1. throughput vs server capacity (server counters, fresh stats window per client)")
    head = (
        "client",
        "prompts",
        "wall s",
        "served tok",
        "util",
        "slot occ.",
        "full-load s",
        "drain s",
        "req/s",
        "client CPU",
        "server CPU",
    )
    rows = []
    for w in out["throughput"]:
        rows.append(
            (
                w["client"],
                f"{w['prompts']:,}",
                f"{w['wall_s']:.1f}",
                f"{w['served_tokens']:,}",
                f"{100 * w['utilisation']:.1f}%",
                f"{100 * w['occupancy']:.1f}%",
                "-" if w["full_load_s"] is None else f"{w['full_load_s']:.1f}",
                "-" if w["drain_s"] is None else f"{w['drain_s']:.1f}",
                f"{w['requests_per_s']:.1f}",
                f"{w['client_cpu_pct']:.0f}%",
                f"{w['server_cpu_pct']:.0f}%",
            )
        )
    harness.table(head, rows)
    a = out["throughput"][0]
    if a["full_load_occupancy"] is not None:
        print(
            f"   (a) slot occupancy while the queue lasted ({a['full_load_s']:.1f} s): "
            f"{100 * a['full_load_occupancy']:.1f}%; then {a['drain_s']:.1f} s draining the longest responses "
            "with free slots"
        )
    print()
    b = out["budget"]
    print(
        f"2. token budget: generate_dataset, budget {b['token_budget']:,} = {p.budget_rounds:g} x mean x max_running "
        f"(one response can overshoot it by <= max_new_tokens = {b['one_response_bound_pct']:.2f}%)"
    )
    harness.table(
        (
            "trial",
            "budget",
            "spent",
            "overshoot",
            "status",
            "responses",
            "aborted",
            "waste (report)",
            "waste (server)",
            "util",
        ),
        [
            (
                f"{x['trial']}",
                f"{x['token_budget']:,}",
                f"{x['spent']:,}",
                f"{x['overshoot_pct']:+.2f}%",
                x["status"],
                f"{x['responses']:,}",
                f"{x['aborted_requests']}",
                f"{x['report_wasted_tokens']:,} ({x['report_waste_pct']:.2f}%)",
                f"{x['server_aborted_tokens']:,} ({x['server_waste_pct']:.2f}%)",
                f"{100 * x['utilisation']:.1f}%",
            )
            for x in b["trials"]
        ],
    )


def print_checkpoint_part(p: Params, out: dict[str, Any]) -> None:
    r, s = out["resume"], out["stats"]
    print()
    print(
        f"3. resume start-up and 4. stats, Parquet checkpoints vs JSONL (best of repeats, warm page cache; "
        f"responses of {r['completion_tokens_mean']:,.0f} completion tokens on average, "
        f"{r['jsonl_bytes_per_response']:,.0f} JSONL bytes each)"
    )
    harness.table(
        ("what", "responses", "parts", "Parquet MB", "ours s", "JSONL MB", "JSONL s", "JSONL / ours", "same answer"),
        [
            (
                "3 resume: done_ids + summarize",
                f"{r['responses']:,}",
                f"{r['parts']}",
                f"{r['parquet_mb']}",
                f"{r['ours_s']:.3f}",
                f"{r['jsonl_mb']}",
                f"{r['jsonl_s']:.2f}",
                f"{r['ratio']:.0f}x",
                "yes" if r["consistent"] else "NO",
            ),
            (
                "3 generate_dataset(), all done",
                f"{r['responses']:,}",
                f"{r['parts']}",
                f"{r['parquet_mb']}",
                f"{r['generate_dataset_noop_s']:.3f}",
                f"{r['jsonl_mb']}",
                f"{r['jsonl_s']:.2f}",
                f"{r['jsonl_s'] / r['generate_dataset_noop_s']:.0f}x",
                "yes" if r["consistent"] else "NO",
            ),
            (
                f"4 collect_stats ({s['datasets']} datasets)",
                f"{s['responses']:,}",
                f"{s['parts']}",
                f"{s['parquet_mb']}",
                f"{s['ours_s']:.3f}",
                f"{s['jsonl_mb']}",
                f"{s['jsonl_s']:.2f}",
                f"{s['ratio']:.0f}x",
                "yes" if s["consistent"] else "NO",
            ),
        ],
    )
    if s["cli_end_to_end_s"] is not None:
        print(
            f"   `eagle3 stats RUN_DIR --json` end to end (interpreter start + imports): {s['cli_end_to_end_s']:.2f} s"
        )
    print(
        "   JSONL time grows with the bytes per response, ours with the number of parts (footers) and ids:"
        " the ratios grow with the response length (--ckpt-mean-len)."
    )


def print_pool_part(out: dict[str, Any]) -> None:
    pool, k = out["pool"], out["pool_kill"]
    print()
    print(
        f"5. several servers: max_running {pool['max_running']}, decode {pool['decode_ms']} ms/token each; "
        f"{pool['slots_per_server']} slots per server (server.max_concurrency); share = served tokens / "
        f"(servers x capacity x wall), the end-of-run drain included"
    )
    harness.table(
        (
            "servers",
            "prompts",
            "wall s",
            "served tok",
            "tok/s",
            "capacity tok/s",
            "share",
            "per server",
            "all recorded",
        ),
        [
            (
                f"{r['servers']}",
                f"{r['prompts']:,}",
                f"{r['wall_s']:.1f}",
                f"{r['served_tokens']:,}",
                f"{r['tok_s']:,.0f}",
                f"{r['capacity_tok_s']:,.0f}",
                f"{100 * r['share']:.1f}%",
                " ".join(f"{100 * x:.0f}%" for x in r["per_server_share"]),
                "yes" if r["complete"] else "NO",
            )
            for r in pool["runs"]
        ],
    )
    print(
        f"   one of {k['servers']} killed (SIGKILL) after {k['killed_after_tokens'] or 0:,} served tokens: "
        f"{k['responses']:,} responses, {k['distinct_ids']:,} distinct ids of {k['prompts']:,} prompts in "
        f"{k['wall_s']:.1f} s -> {'exactly once' if k['exactly_once'] else 'NOT exactly once'}"
    )
