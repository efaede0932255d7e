"""The GPU check's phases: target, records, capture, train, export and eval, each a function of the check.

Each runs the pipeline's own code the way the stage tasks run it and returns its figures (tools/gpu_check.py's
docstring lists them); a failure raises, and `Check.phase` reports it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from bench import harness
from settings.layout import RunLayout  # plain Python: `work` is laid out as a run directory
from settings.target import Target
from tools.gpu_check_params import Params
from tools.gpu_check_run import Check

DATASET = "check"


def memory_figures(memory: list[dict[str, int]]) -> dict[str, Any]:
    """The largest peaks over a launch's processes (RANK_MEMORY lines), in GiB."""
    gib = 2**30
    out: dict[str, Any] = {"host_peak_rss_gib": round(max((m["host_peak_rss"] for m in memory), default=0) / gib, 3)}
    if any("gpu_peak_allocated" in m for m in memory):
        out["gpu_peak_allocated_gib"] = round(max(m.get("gpu_peak_allocated", 0) for m in memory) / gib, 3)
        out["gpu_peak_reserved_gib"] = round(max(m.get("gpu_peak_reserved", 0) for m in memory) / gib, 3)
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def build_target(p: Params, work: Path) -> dict[str, Any]:
    """The widened tiny target; its parameters counted from the checkpoint's headers."""
    from safetensors import safe_open

    from models.target.tiny import build_tiny_target

    target = build_tiny_target(work / "target", **p.target_shape(), train_steps=p.target_train_steps, device=p.device)
    params = 0
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                params += math.prod(st.get_slice(key).get_shape())
    config = json.loads((target / "config.json").read_text())
    return {
        "path": str(target),
        "params_m": round(params / 1e6, 1),
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "checkpoint_mb": round(dir_bytes(target) / 1e6, 1),
    }


def make_records(p: Params, work: Path, target: Path) -> dict[str, Any]:
    """Records of the target's greedy continuations of random prompts (loss on the continuation), and token counts.

    Generated on the check's device in its dtype, eos suppressed (`min_new_tokens`): every record has
    the same length, so the capture and training throughputs measure full batches. The labels the
    draft learns are the target's own distributions (from the captured final hidden states), not these
    tokens, so suppressing eos biases nothing the draft is trained on.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tasks.records.build import count_tokens

    hf_logging.set_verbosity_error()
    device = torch.device(p.device)
    dtype = torch.bfloat16 if p.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    vocab = int(model.config.vocab_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(p.seed)
    prompts = torch.randint(8, vocab, (p.prompts, p.prompt_tokens), generator=g)  # ids 0..7: the special tokens
    rows, generated = [], 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for k in range(0, p.prompts, p.gen_batch):
            chunk = prompts[k : k + p.gen_batch].to(device)
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=p.new_tokens,
                min_new_tokens=p.new_tokens,
                do_sample=False,
                pad_token_id=0,
            ).cpu()
            generated += (out.shape[1] - p.prompt_tokens) * out.shape[0]
            rows += [harness.record_row(f"g{k + i:05d}", seq.tolist(), p.prompt_tokens) for i, seq in enumerate(out)]
    generate_s = time.perf_counter() - t0
    figures = {
        "records": len(rows),
        "tokens": sum(r["num_tokens"] for r in rows),
        "loss_tokens": sum(r["num_loss_tokens"] for r in rows),
        "generate_s": round(generate_s, 2),
        "generate_tokens_per_s": round(generated / generate_s, 1),
    }
    if device.type == "cuda":
        figures["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ranks get the GPU to themselves (but for this process's context)
    layout = RunLayout(work)
    harness.write_records(rows, layout.records(DATASET), rows_per_part=256)
    count_tokens([layout.records(DATASET)], layout.token_counts, vocab)
    return figures


def capture(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.capture` on 1 rank (replicate): tokens/s of the forward phase and of the whole launch, stored bytes."""
    from models.capture.shards import list_shards
    from models.common.job_files import CaptureJobFile
    from models.common.rank_protocol import CAPTURE
    from tasks.runtime.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    job = CaptureJobFile(
        target=Target(path=str(target)),
        datasets=[{"name": DATASET, "records_dir": str(layout.records(DATASET))}],
        out_dir=str(layout.hidden_dir),
        device=p.device,
        mode="replicate",
        dtype="bfloat16" if p.bf16 else "float32",
        max_batch_tokens=p.capture_batch_tokens,
        shard_tokens=p.shard_tokens,
        launch_tokens=None,
    )
    job_path = layout.job("capture")
    write_job(job, job_path, kept=lambda: "nothing yet", resume="run the check again")
    run = check.launch("models.capture", job_path, CAPTURE, limit_s)
    progress = [(t, m.values) for t, m in run["messages"]]
    if not progress:
        raise RuntimeError("the capture printed no progress")
    (t_first, _), (t_last, last) = progress[0], progress[-1]
    forward_s = max(1e-9, t_last - t_first)
    stored = sum(f.stat().st_size for f in list_shards(layout.hidden_dir))
    return {
        "samples": last["done"],
        "tokens": last["tokens"],
        "startup_s": round(t_first - run["started"], 2),
        "forward_s": round(forward_s, 2),
        "tokens_per_s": round(last["tokens"] / forward_s, 1),
        "end_to_end_tokens_per_s": round(last["tokens"] / (run["ended"] - run["started"]), 1),
        "stored_gb": round(stored / 1e9, 3),
        "bytes_per_token": round(stored / max(1, last["tokens"]), 1),
        **memory_figures(run["memory"]),
    }


def train(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.train` (ZeRO-2) on 1 rank: steps/s and tokens/s between metrics lines, losses, the held-out estimate."""
    from models.common.job_files import TrainJobFile
    from models.common.rank_protocol import TRAIN, TRAIN_PROGRESS
    from tasks.runtime.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    job = TrainJobFile(
        target=Target(path=str(target)),
        out_dir=str(layout.draft_dir),
        token_counts=str(layout.token_counts),
        mode="offline",
        hidden_dir=str(layout.hidden_dir),
        draft_vocab_size=p.draft_vocab_size,
        ttt_steps=p.ttt_steps,
        max_steps=p.steps,
        max_batch_tokens=p.train_batch_tokens,
        lr=p.lr,
        warmup_ratio=p.warmup_ratio,
        checkpoint_every=p.steps,
        keep_checkpoints=1,
        eval_every=p.steps,
        eval_fraction=p.eval_fraction,
        log_every=p.log_every,
        seed=p.seed,
        device=p.device,
        precision="bf16" if p.bf16 else "fp32",
    )  # the optimizer: the train section's declared defaults
    job_path = layout.job("train")
    write_job(job, job_path, kept=lambda: "nothing yet", resume="run the check again")
    run = check.launch("models.train", job_path, TRAIN, limit_s)
    step0 = next((t for t, m in run["messages"] if m.kind is TRAIN_PROGRESS and m.values["step"] == 0), None)
    lines = [json.loads(x) for x in layout.metrics.read_text().splitlines() if x.strip()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    first = next(x for x in train_lines if x["step"] >= max(p.skip_steps, p.log_every))
    last = train_lines[-1]
    window_s = max(1e-9, last["time"] - first["time"])
    summary = json.loads(layout.train_summary.read_text())
    held_out = summary.get("eval") or {}
    figures = {
        "steps": last["step"],
        "tokens": last["tokens"],
        "window_steps": last["step"] - first["step"],
        "steps_per_s": round((last["step"] - first["step"]) / window_s, 3),
        "tokens_per_s": round((last["tokens"] - first["tokens"]) / window_s, 1),
        "startup_s": round(step0 - run["started"], 2) if step0 else None,
        "tail_s": round(run["ended"] - last["time"], 2),  # final eval, checkpoint, export, teardown
        "first_loss": train_lines[0]["loss"],
        "final_loss": last["loss"],
        "held_out_loss": held_out.get("loss"),
        "held_out_acceptance_length": held_out.get("acceptance_length"),
        "checkpoint_mb": round(dir_bytes(layout.checkpoints) / 1e6, 1),
        **memory_figures(run["memory"]),
    }
    if not all(math.isfinite(x) for x in (figures["first_loss"], figures["final_loss"])):
        raise RuntimeError(f"the training loss is not finite: {figures['first_loss']} -> {figures['final_loss']}")
    return figures


def check_export(p: Params, work: Path) -> dict[str, Any]:
    """The export in draft/final/: validated for SGLang and vLLM and loaded back (models.export.eagle3), its size."""
    import torch

    from models.export.eagle3 import load_exported_draft
    from models.export.sglang import validate_export
    from models.export.vllm import validate_export_vllm

    final = RunLayout(work).final
    problems = validate_export(final) + [f"vLLM: {x}" for x in validate_export_vllm(final)]
    if problems:
        raise ValueError(f"{final} is not a valid EAGLE-3 export: {problems}")
    draft = load_exported_draft(final, dtype=torch.float32)
    config = json.loads((final / "config.json").read_text())
    return {
        "path": str(final),
        "export_mb": round(dir_bytes(final) / 1e6, 2),
        "params_m": round(sum(x.numel() for x in draft.parameters()) / 1e6, 2),
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "architectures": config.get("architectures"),
    }


def evaluate(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.eval`: acceptance length of the trained and the untrained draft on held-out prompts.

    Each prompt's figures (its EVAL_PROGRESS line: new tokens, verify rounds, accepted draft tokens)
    go into the JSON as they come, with the acceptance length so far (`partial_eval`): an eval
    killed at its limit leaves them, the trained draft's first (models/eval/job.py runs it first).
    """
    from models.common.job_files import EvalJobFile
    from models.common.rank_protocol import EVAL
    from tasks.runtime.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    raw = layout.eval_raw
    job = EvalJobFile(
        prompts=p.eval_prompts,
        max_new_tokens=p.eval_new_tokens,
        num_steps=p.eval_num_steps,
        device=p.device,
        compare_untrained=True,
        eval_fraction=p.eval_fraction,
        seed=p.seed,
        target=Target(path=str(target)),
        datasets=[{"name": DATASET, "records_dir": str(layout.records(DATASET))}],
        draft_dir=str(layout.final),
        out=str(raw),
    )
    job_path = layout.job("eval")
    write_job(job, job_path, kept=lambda: "the export", resume="run the check again")
    per_prompt: dict[str, list[dict[str, int]]] = {}

    def on_progress(message: Any) -> None:
        v = message.values
        if "rounds" not in v:
            return
        per_prompt.setdefault(v["draft"], []).append(
            {"prompt": v["done"], "new_tokens": v["new_tokens"], "rounds": v["rounds"], "accepted": v["accepted"]}
        )
        check.progress(num_steps=p.eval_num_steps, **partial_eval(per_prompt, total=v["total"]))

    run = check.launch("models.eval", job_path, EVAL, limit_s, single_process=True, on_progress=on_progress)
    result = json.loads(raw.read_text())
    trained, untrained = result["trained"], result.get("untrained", {})
    return {
        "prompts": result["prompts"],
        "device": result["device"],
        "num_steps": p.eval_num_steps,
        "acceptance_length": trained["acceptance_length"],
        "per_position": trained["per_position_acceptance"],
        "untrained_acceptance_length": untrained.get("acceptance_length"),
        "rounds": trained["rounds"],
        "new_tokens": trained["new_tokens"],
        "per_prompt": per_prompt,
        **memory_figures(run["memory"]),
    }


def partial_eval(per_prompt: dict[str, list[dict[str, int]]], *, total: int) -> dict[str, Any]:
    """The eval's figures from the prompts done so far: acceptance length per draft (SGLang's, over their rounds)."""

    def length(prompts: list[dict[str, int]]) -> float | None:
        rounds = sum(x["rounds"] for x in prompts)
        return round((sum(x["accepted"] for x in prompts) + rounds) / rounds, 4) if rounds else None

    trained, untrained = per_prompt.get("trained", []), per_prompt.get("untrained", [])
    return {
        "prompts": total,
        "prompts_done": {name: len(x) for name, x in per_prompt.items()},
        "acceptance_length": length(trained),
        "untrained_acceptance_length": length(untrained),
        "rounds": sum(x["rounds"] for x in trained),
        "new_tokens": sum(x["new_tokens"] for x in trained),
        "per_prompt": per_prompt,
    }
