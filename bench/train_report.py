"""The train-stage bench's report: its tables and readings, from the `out` a run built.

bench/train.py measures and calls `print_report`; the tables go through bench/harness.py.
"""

from __future__ import annotations

from typing import Any

from bench import harness
from bench.train_baselines import BETAS
from bench.train_params import Params


def print_report(p: Params, out: dict[str, Any]) -> None:
    s = out["setup"]
    runs = out["runs"]
    b1 = next((r for r in runs if r["kind"] == "baseline" and r.get("trainable_parameters")), None)
    print()
    print(
        f"target: tiny Llama hidden {p.hidden_size}, {p.num_layers} layers, {p.num_heads} heads / {p.num_kv_heads} kv, "
        f"intermediate {p.intermediate_size}, vocab {p.vocab_size} ({s['target']})"
    )
    print(
        f"draft: 1 layer, hidden {p.hidden_size}, draft vocab {p.draft_vocab_size}, TTT {p.ttt_steps} steps"
        + (f", {b1['trainable_parameters']:,} trainable parameters" if b1 else "")
        + "; fp32"
    )
    print(
        f"data: {s['records']} records (sample conversations cut to {p.max_prompt_tokens} tokens + greedy continuation "
        f"<= {p.max_new_tokens}): {s['tokens']:,} tokens, mean {s['mean_len']:.0f}, p50 {s['p50_len']}, "
        f"p95 {s['p95_len']}, max {s['max_len']}; {s['train_samples']} train / {s['held_out']} held out; "
        f"{s['batches_per_epoch']} micro "
        f"batches per epoch at max_batch_tokens {p.max_batch_tokens} ({s['tokens_per_batch']:,.0f} real tokens each, "
        f"{s['padding_pct']:.1f}% padding)"
    )
    print(
        f"job: ZeRO stage {p.zero_stage}, {p.steps} optimizer steps, grad_accum {p.grad_accum}, lr {p.lr:g} "
        f"(warmup {p.warmup_ratio:g}), AdamW betas {BETAS} wd {p.weight_decay:g}, clip {p.grad_clip:g}, "
        f"log every {p.log_every}; measured: steps "
        f"{p.skip + 1}-{p.steps}; {p.threads} thread(s) per rank / baseline process"
    )
    print()
    print("runs (tok/s over the measured steps, all ranks)")
    rows = []
    for r in runs:
        label = f"#{r['pass_no'] + 1} " + (
            f"ours, {r['n']} rank(s)" if r["kind"] == "ours" else f"baseline, {r['n']} process(es)"
        )
        if not r.get("tokens_per_s"):
            rows.append((label, "FAILED", "-", "-", "-", "-", "-", "-"))
            continue
        cpu = f"{r['cpu_ms_per_1k_tokens']:.0f}" if r.get("cpu_ms_per_1k_tokens") else "-"
        share = f"{r['cpu_s'] / (r['window_s'] * r['n']):.2f}" if r.get("cpu_s") else "-"
        head = (label, f"{r['tokens_per_s']:,.0f}", f"{r['window_s']:.1f}", cpu, share)
        if r["kind"] == "ours":
            rows.append(
                (
                    *head,
                    f"{r['startup_s']:.1f}",
                    f"{r['steps_s']:.1f}",
                    f"{r['tail_s']:.1f}",
                    f"{r['wall_s']:.1f}",
                    f"agent CPU {r.get('launcher_cpu_s', 0):.2f} s"
                    + (f"; built {', '.join(r['ops_built'])}" if r["ops_built"] else ""),
                )
            )
        else:
            rows.append((*head, "-", "-", "-", "-", f"median step {1e3 * r['median_step_s']:.0f} ms"))
    harness.markdown_table(
        (
            "run",
            "tok/s",
            "measured s",
            "CPU ms/1k tok",
            "CPU/wall",
            "start-up s",
            "all steps s",
            "tail s",
            "launch s",
            "notes",
        ),
        rows,
    )
    print(
        "   measured: steps after the skip; CPU: the ranks' (ours) or the processes' (baseline) over those steps;\n"
        "   CPU/wall: CPU s / (measured s x processes): 1.00 = each process had a core to itself all along.\n"
        "   start-up: launch -> TRAIN_PROGRESS step=0 (interpreter, imports, process group, data index, draft, engine);"
        "\n   all steps: -> the last step's metrics line; tail: final eval + checkpoint + export + teardown;"
        "\n   agent: the torchrun agent's CPU over the measured steps; built: torch extensions (re)built meanwhile"
    )
    print()
    multi = p.repeats > 1
    print(
        "ratios: ours tok/s / baseline tok/s of the same pass (1.00 = no overhead; < 1 = ours slower)"
        + (f"; median of {p.repeats} passes [range]" if multi else "")
    )
    rows = []
    for n, x in out["ratios"].items():
        lo, hi = x["ratio_range"]
        base = "1 process" if n == "1" else f"{n} processes side by side"
        cpu = (
            "-"
            if x["cpu_ratio"] is None
            else f"{x['cpu_ratio']:.3f}"
            + (f" [{x['cpu_ratio_range'][0]:.2f}-{x['cpu_ratio_range'][1]:.2f}]" if multi else "")
        )
        per = (
            "-"
            if x["per_rank_vs_1_process"] is None
            else (
                f"{x['per_rank_vs_1_process']:.2f}" + ("" if n == "1" else f" ({x['baseline_per_process_vs_1']:.2f})")
            )
        )
        paired = (
            "-"
            if x["paired_ratio"] is None
            else f"{x['paired_ratio']:.3f}"
            + (f" [{x['paired_ratio_range'][0]:.2f}-{x['paired_ratio_range'][1]:.2f}]" if multi else "")
        )
        rows.append(
            (
                f"{n} rank(s)",
                f"{x['ours']:,.0f}",
                base,
                f"{x['baseline']:,.0f}",
                f"{x['ratio']:.3f}" + (f" [{lo:.2f}-{hi:.2f}]" if multi else ""),
                paired,
                cpu,
                f"{s['lockstep'][n]['bound']:.3f}",
                per,
                f"{x['startup_s']:.1f} + {x['tail_s']:.1f}",
                f"{x['end_to_end_ratio']:.3f}",
            )
        )
    harness.markdown_table(
        (
            "ours",
            "tok/s",
            "baseline",
            "tok/s",
            "ours/baseline",
            "paired per step",
            "tok per CPU-s, ours/baseline",
            "lockstep bound",
            "per rank / 1-process baseline (baseline's)",
            "start-up + tail s",
            "whole launch / baseline",
        ),
        rows,
    )
    print(
        "   paired per step: median over the measured steps of baseline step time / ours (same micro batches; "
        "N ranks: the"
        "\n   slowest baseline process's step, so lockstep waiting is not counted): robust to bursts of other load"
        "\n   lockstep bound: the ratio that waiting for the slowest rank at every step alone gives "
        "(padded tokens as the cost);"
        "\n   per rank / 1-process baseline: ours' tok/s per rank over the 1-process baseline's "
        "(in brackets: the same for"
        "\n   one of the side-by-side baseline processes: what the cores give N processes); "
        "whole launch: all tokens / launch"
        "\n   wall time (start-up, warmup steps, final eval, checkpoint, export included) over the baseline's tok/s"
    )
    x = out.get("interleaved")
    if x:
        print()
        print(
            "in-process, interleaved (1 rank, one process, the same batch tensors; "
            f"steps {p.skip + 1}-{p.in_process_steps}; ms per step, mean):"
        )
        rows = [
            (
                name,
                f"{x[key]['forward_ms']:.1f}",
                f"{x[key]['backward_ms']:.1f}",
                f"{x[key]['rest_ms']:.1f}",
                f"{x[key]['step_ms']:.1f}",
                f"{x[key]['tokens_per_s']:,.0f}",
            )
            for name, key in (("plain PyTorch step", "plain"), ("our step: DeepSpeed engine + job loop body", "ours"))
        ]
        harness.markdown_table(("step", "forward ms", "backward ms", "rest ms", "step ms", "tok/s"), rows)
        print(
            f"   ours/plain tok/s {x['ratio']:.3f}; per step, ours - plain: median {x['extra_ms_per_step']:+.1f} ms, "
            f"mean {x['extra_ms_per_step_mean']:+.1f} ms; ours/plain step time, median {x['step_ratio_median']:.3f};"
            f"\n   losses differ by at most {x['loss_max_rel_diff']:.1e} (relative); "
            "loading a step's batch (HiddenSource.batch,"
            f" in both loops, not timed above): {x['load_ms']:.1f} ms\n"
            "   rest: plain = clip + AdamW + LambdaLR + zero_grad; ours = engine.step (ZeRO-2 reduce, norm, clip, "
            "AdamW on"
            f" the\n   flat partition, copy back, scheduler) + engine.train() + the per-step token all-reduce + every "
            f"{p.log_every} step(s)\n   the job's metrics line (all-reduces, grad norm, metrics.jsonl, TensorBoard)"
        )
    one = out["ratios"].get("1")
    if one and one.get("loss_max_rel_diff") is not None:
        a, b = one["loss_first_last"]
        print(
            f"   1 rank, same arithmetic: the logged losses of ours and the baseline differ by at most "
            f"{one['loss_max_rel_diff']:.1e} (relative; loss {a:.3f} at step {p.log_every} -> {b:.3f} "
            f"at step {p.steps})"
        )
