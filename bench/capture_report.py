"""The capture-stage bench's report: its tables and readings, from the `out` a run built.

bench/capture.py measures and calls `print_report`; the tables go through bench/harness.py.
"""

from __future__ import annotations

from typing import Any

from bench import harness
from bench.capture_params import Params


def projected_overhead_pct(s: dict[str, Any], hidden: int, dtype_bytes: int, mean_len: float | None = None) -> float:
    """The format's overhead (ids, mask, headers) at another hidden size / dtype (and sample length)."""
    payload = 4 * hidden * dtype_bytes
    header = s["header_per_token"] if mean_len is None else s["header_per_sample"] / mean_len
    return 100 * (s["ids_mask_per_token"] + header) / payload


def print_report(p: Params, out: dict[str, Any]) -> None:
    s = out["setup"]
    multi = p.repeats > 1
    tag = (lambda x: x["label"] + f" #{x['pass_no'] + 1}") if multi else (lambda x: x["label"])
    print()
    print(
        f"target: Llama hidden {p.hidden_size}, {p.num_layers} layers, {p.num_heads} heads / {p.num_kv_heads} kv, "
        f"intermediate {p.intermediate_size}, vocab {s['vocab_size']}, {s['parameters'] / 1e6:.1f}M parameters, "
        f"{p.dtype}; aux layers {s['aux_layers']}"
    )
    r = s["records"]
    print(
        f"records: {r['records']} in {r['parts']} parts, {s['captured_tokens']:,} tokens (lognormal mean "
        f"{p.mean_len:g} sigma {p.sigma}: mean {r['mean_len']:.0f}, p50 {r['p50_len']}, p95 {r['p95_len']}, max "
        f"{r['max_len']}); max_batch_tokens {p.max_batch_tokens}: {s['batches_1_rank']} batches at 1 rank, "
        f"{s['padding_pct']:.1f}% padding; shard_tokens {p.shard_tokens}"
    )
    print()
    print(
        "1. capture throughput: baselines (fresh processes, the loop timed) and our job (torchrun, the forward phase "
        "timed)"
    )
    rows = []
    for b in out["bare"]:
        rows.append(
            (
                tag(b),
                f"{b['processes']}",
                f"{b['threads']}",
                f"{b['startup_s']:.1f}",
                f"{b['wall_s']:.1f}",
                "-",
                f"{b['tokens_per_s']:,.0f}",
                f"{b['cpu_s']:.1f}",
                f"{1e6 * b['cpu_s'] / b['tokens']:.0f}",
                "-",
            )
        )
    for x in out["launches"]:
        if x["tokens_per_s"] is None:
            rows.append(
                (tag(x), f"{x['ranks']}", f"{p.threads}", "FAILED", "-", "-", "-", "-", "-", f"{x['wall_s']:.1f}")
            )
            continue
        cpu = x["forward_cpu_s"]
        rows.append(
            (
                tag(x),
                f"{x['ranks']}",
                f"{p.threads}",
                f"{x['startup_s']:.1f}",
                f"{x['forward_s']:.1f}",
                f"{x['tail_s']:.1f}",
                f"{x['tokens_per_s']:,.0f}",
                "-" if cpu is None else f"{cpu:.1f} + {x['launcher_cpu_s']:.1f}",
                "-" if cpu is None else f"{1e6 * cpu / x['tokens']:.0f}",
                f"{x['wall_s']:.1f} ({x['end_to_end_tokens_per_s']:,.0f} tok/s)",
            )
        )
    harness.table(
        (
            "run",
            "procs",
            "threads",
            "start-up s",
            "forward s",
            "tail s",
            "tok/s",
            "CPU s",
            "CPU ms/1k tok",
            "whole job s",
        ),
        rows,
    )
    ra = out["ratios"]
    print(
        "   start-up: baselines spawn -> model loaded; ours launch -> first rank's done=0 line. tail: last final "
        "line -> launcher exit.\n   CPU s of ours: ranks + launcher (torchrun agent); CPU ms/1k tok: ranks only"
    )
    print(
        f"   bare, 1 process: {ra['bare_tokens_per_s']:,.0f} tok/s, {ra['bare_cpu_ms_per_1k_tokens']:.0f} CPU ms per "
        f"1k tokens; before and after (a) differ by up to {ra['bare_spread_pct']:.1f}% (other load on the machine)"
    )
    print(
        f"   these cores: {p.ranks} bare processes side by side give {ra['parallel_speedup']:.2f}x one bare process, "
        f"one process on {p.ranks * p.threads} threads {ra['all_cores_speedup']:.2f}x"
    )
    print()
    print("   ratios to the baseline measured in the same pass" + (f" (median of {p.repeats} passes)" if multi else ""))
    rows = []
    for label, x in ra["runs"].items():
        lo, hi = x["overhead_ratio_range"]
        rows.append(
            (
                label,
                f"{x['tokens_per_s']:,.0f}",
                x["baseline"],
                f"{x['baseline_tokens_per_s']:,.0f}",
                f"{x['overhead_ratio']:.3f}" + (f" ({lo:.2f}-{hi:.2f})" if multi else ""),
                "-" if x["cpu_ratio"] is None else f"{x['cpu_ratio']:.3f}",
                f"{x['vs_bare_1_process']:.3f}",
                f"{x['vs_bare_all_cores']:.3f}",
                "-" if x["end_to_end_ratio"] is None else f"{x['end_to_end_ratio']:.2f}",
            )
        )
    harness.table(
        (
            "run",
            "tok/s",
            "baseline",
            "tok/s",
            "baseline/ours",
            "CPU/token ours/baseline",
            "bare 1 proc/ours",
            f"bare {p.ranks * p.threads} thr/ours",
            "baseline/ours incl. start-up",
        ),
        rows,
    )
    print(
        "   baseline/ours > 1: ours is slower than its baseline by that factor. CPU/token: CPU seconds per captured "
        "token,\n   less sensitive than wall time to other load on the machine"
    )
    w = out["writer"]
    print(
        f"   ShardWriter alone (cat, safetensors, fsync; best pass): {w['mb_per_s']:,.0f} MB/s, "
        f"{w['us_per_token']:.0f} us per token = {100 * w['share_of_bare_forward']:.1f}% of the bare forward's "
        f"{w['bare_forward_us_per_token']:.0f} us per token"
    )

    per = [
        (
            tag(x),
            f"rank {q['rank']}",
            f"{q['start_s']:.1f}",
            f"{q['end_s']:.1f}",
            f"{q['tokens']:,}",
            f"{q['tokens_per_s']:,.0f}" if q["tokens_per_s"] else "-",
        )
        for x in out["launches"]
        for q in x["per_rank"]
        if q["start_s"] is not None
    ]
    if per:
        print()
        print("   per rank (seconds after launch)")
        harness.table(("run", "rank", "done=0 at", "final at", "tokens", "tok/s"), per)
    rows = [
        (
            tag(x),
            f"{x['planned_s']:.1f}" if x["planned_s"] else "-",
            f"{x['startup_s']:.1f}",
            f"{x['tail_s']:.1f}",
            ", ".join(x["ops_built"]) or "-",
        )
        for x in out["launches"]
        if x["ok"] and x["startup_s"] is not None
    ]
    if rows:
        print()
        print(
            "   start-up (seconds after launch): rank 0 planned (interpreter, torchrun, imports, config, process "
            "group,\n   records read), first done=0 (model loaded; ZeRO-3: partitioned); tail = last final line -> "
            "launcher exit;\n   a DeepSpeed CPU comm op (re)built meanwhile (JIT, ~45 s on 2 cores) is part of the "
            "start-up"
        )
        harness.table(("run", "planned", "done=0", "tail", "torch extension built meanwhile"), rows)
        print(
            f"   a bare process: spawn -> model loaded {ra['bare_startup_s']:.1f} s (interpreter, imports, "
            f"from_pretrained {min(b['model_load_s'] for b in out['bare']):.2f} s)"
        )

    print()
    st = [x for x in out["launches"] if x.get("storage") and x["storage"].get("tokens") and x["pass_no"] == 0]
    if st:
        g = st[0]["storage"]
        h, db = g["hidden_size"], g["dtype_bytes"]
        print(
            f"2. stored bytes per token (H = {h}, {p.dtype}: payload 4H x {db} B = {g['payload_per_token']:,} B/token)"
        )
        rows = []
        for x in st:
            q = x["storage"]
            rows.append(
                (
                    x["label"],
                    f"{q['shards']}",
                    f"{q['samples']}",
                    f"{q['tokens']:,}",
                    f"{q['shard_bytes'] / 2**20:,.1f}",
                    f"{q['bytes_per_token']:,.2f}",
                    f"{q['payload_per_token']:,}",
                    f"{q['ids_mask_per_token']}",
                    f"{q['header_per_token']:.2f}",
                    f"{q['overhead_pct']:.3f}%",
                    f"{q['index_per_token']:.3f}",
                    "yes" if q["data_matches_layout"] else "NO",
                )
            )
        harness.table(
            (
                "run",
                "shards",
                "samples",
                "tokens",
                "MiB",
                "B/token",
                "payload",
                "ids+mask",
                "header",
                "overhead",
                "index B/tok",
                "layout ok",
            ),
            rows,
        )
        print(
            f"   header {g['header_per_sample']:.0f} B per sample (tensor table + JSON sample list); planner estimate "
            f"{g['planner_per_token']:,} B/token (4H x dtype + 5).\n   The format's overhead with these samples at "
            f"bf16 H={h}: {projected_overhead_pct(g, h, 2):.3f}%; bf16 H=7168 (Kimi): "
            f"{projected_overhead_pct(g, 7168, 2):.4f}%, or {projected_overhead_pct(g, 7168, 2, 1400):.4f}% "
            "with 1,400-token samples"
        )
        checks = [
            (
                x["label"],
                f"{x['check']['samples_compared']}",
                f"{x['check']['max_abs_diff']:.2e}",
                f"{x['check']['samples_indexed']}",
            )
            for x in st
            if x.get("check")
        ]
        print()
        print("   stored rows vs the bare loop's hidden states (the longest and the shortest sample):")
        harness.table(("run", "samples", "max abs diff", "samples in index"), checks)
