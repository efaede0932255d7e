"""The GPU check's report: the phases (ok, wall time, error) and every figure, as text tables."""

from __future__ import annotations

from typing import Any

from bench import harness


def report(out: dict[str, Any]) -> None:
    m, ph = out["machine"], out["phases"]

    def get(phase: str, key: str, fmt: str = "") -> str:
        value = ph.get(phase, {}).get(key)
        return "-" if value is None else format(value, fmt) if fmt else str(value)

    print("\nphases")
    harness.table(
        ["phase", "ok", "wall s", "what"],
        [
            [
                name,
                "yes"
                if r.get("ok")
                else "skipped"
                if "skipped" in r
                else "TIMED OUT"
                if r.get("timed_out")
                else "FAILED",
                get(name, "wall_s", ".1f"),
                (r.get("skipped") or r.get("error", ""))[:90].replace("\n", " "),
            ]
            for name, r in ph.items()
        ],
    )
    print("\nfigures")
    harness.table(
        ["figure", "value"],
        [
            ["target: parameters (M) / vocab", f"{get('target', 'params_m')} / {get('target', 'vocab_size')}"],
            ["records: records / tokens", f"{get('records', 'records')} / {get('records', 'tokens')}"],
            ["records: generate tokens/s (HF generate)", get("records", "generate_tokens_per_s", ",.0f")],
            ["capture: tokens/s (forward phase)", get("capture", "tokens_per_s", ",.0f")],
            ["capture: tokens/s (launch to exit)", get("capture", "end_to_end_tokens_per_s", ",.0f")],
            ["capture: start-up s", get("capture", "startup_s", ".1f")],
            [
                "capture: stored GB / bytes per token",
                f"{get('capture', 'stored_gb')} / {get('capture', 'bytes_per_token')}",
            ],
            [
                "capture: GPU peak allocated / reserved GiB",
                f"{get('capture', 'gpu_peak_allocated_gib')} / {get('capture', 'gpu_peak_reserved_gib')}",
            ],
            ["train: steps/s", get("train", "steps_per_s", ".2f")],
            ["train: tokens/s", get("train", "tokens_per_s", ",.0f")],
            ["train: start-up s / tail s", f"{get('train', 'startup_s', '.1f')} / {get('train', 'tail_s', '.1f')}"],
            [
                "train: loss first -> final",
                f"{get('train', 'first_loss', '.4f')} -> {get('train', 'final_loss', '.4f')}",
            ],
            ["train: held-out TTT acceptance length", get("train", "held_out_acceptance_length", ".3f")],
            [
                "train: GPU peak allocated / reserved GiB",
                f"{get('train', 'gpu_peak_allocated_gib')} / {get('train', 'gpu_peak_reserved_gib')}",
            ],
            ["train: host peak RSS GiB", get("train", "host_peak_rss_gib")],
            ["export: MB / parameters (M)", f"{get('export', 'export_mb')} / {get('export', 'params_m')}"],
            [
                "eval: acceptance length trained / untrained",
                f"{get('eval', 'acceptance_length', '.3f')} / {get('eval', 'untrained_acceptance_length', '.3f')}"
                + (
                    ""
                    if ph.get("eval", {}).get("ok") or "prompts_done" not in ph.get("eval", {})
                    else f" (partial: {', '.join(f'{k} {n}' for k, n in ph['eval']['prompts_done'].items())} "
                    f"of {ph['eval']['prompts']} prompts)"
                ),
            ],
            ["eval: GPU peak allocated GiB", get("eval", "gpu_peak_allocated_gib")],
        ],
    )
    gpu = (
        f"{m.get('gpu')} ({m.get('gpu_memory_gib')} GiB, driver {m.get('driver')})"
        if m.get("cuda_available")
        else "no GPU"
    )
    print(
        f"\n{gpu}; torch {m['torch']} (CUDA {m['cuda']}, NCCL {m.get('nccl')}), deepspeed {m['deepspeed']}, "
        f"transformers {m['transformers']}, Python {m['python']}, {m['cpus']} CPUs"
    )
    print(f"total {out['total_s']:.0f} s; {'every phase passed' if out['ok'] else 'SOME PHASES FAILED'}")
