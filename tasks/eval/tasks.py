"""Prefect tasks of the eval stage: speculative decoding with the target and the exported draft, measured in-process
(HF backend) and/or through the serving engine (tasks/serving/eval_server.py), then eval.json and the artifacts."""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import aupdate_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.utilities.asyncutils import run_coro_as_sync

from models.common.atomic import write_atomic
from models.common.job_files import EvalJobFile
from models.common.rank_protocol import EVAL, Message
from models.eval.context import context_text
from models.eval.estimates import chain_acceptance_length, estimates_block
from models.eval.prompts import benchmark_prompts, eval_prompts
from models.export.rules import read_export_config
from settings.eval import ServedEvalSettings
from settings.layout import TRAIN_SUMMARY
from tasks.eval.benchmarks import benchmark_rows, benchmark_section
from tasks.eval.engine_report import acceptance, compare_with_hf, context_of, engine_report
from tasks.generate.prompts import default_stop_ids, request_sampling_params
from tasks.runtime.artifacts import artifact_key, progress_artifact
from tasks.runtime.heartbeat import Heartbeat
from tasks.runtime.launch_ranks import follow_job, write_job
from tasks.serving.client import RetryPolicy, auth_hint
from tasks.serving.eval_server import EvalServer, Phase, check_command, decode_prompts, fit_draft_context
from tasks.serving.sglang import SGLangClient
from tasks.serving.vllm import VLLMClient
from tasks.serving.watch import ServerWatch


@task(name="spec-eval", cache_policy=NO_CACHE)
def evaluate_draft(job: EvalJobFile, job_path: Path, config_name: str) -> dict[str, Any]:
    """HF backend: chain speculative decoding (greedy target, top-1 draft) in-process on the eval prompts.

    Returns {"prompts", "device", "untrained"?, "trained"} (models/eval/job.py); eval.json is written by `publish_eval`.
    """
    logger = get_run_logger()
    final = _exported(job)
    write_job(
        job,
        job_path,
        kept=lambda: f"the exported draft in {final} (nothing was evaluated yet)",
        resume="make room there, then run the eval stage again",
    )
    artifact = progress_artifact(progress=0.0, key=artifact_key("eval", config_name), description="eval: starting")
    drafts = (2 if job.compare_untrained else 1) + len(job.benchmarks)  # each draft, then each benchmark (trained)

    def show(progress: float, description: str) -> None:
        update_progress_artifact(artifact, progress=progress, description=description)

    raw_path = Path(job.out)
    raw_path.parent.mkdir(parents=True, exist_ok=True)  # RUN_DIR/evals/<draft>/ for a draft from elsewhere
    raw_path.unlink(missing_ok=True)
    # Batch-1 decoding is many tiny ops: one CPU thread beats two that spin-wait for each other
    # (measured 20x on 2 busy cores); on GPUs it does not matter.
    with Heartbeat(logger.info) as beat:
        follow_job(
            [sys.executable, "-m", "models.eval", "--job", str(job_path)],
            protocol=EVAL,
            log=beat.log,
            on_message=SpecEvalProgress(beat, drafts, show).on_message,
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
    results = json.loads(raw_path.read_text())
    raw_path.unlink()
    update_progress_artifact(
        artifact, progress=100.0, description=f"eval: acceptance length {results['trained']['acceptance_length']:.3f}"
    )
    return results


class SpecEvalProgress:
    """The spec-eval's progress from its EVAL_PROGRESS lines: the progress artifact after each prompt, and the
    heartbeat's status, logged when the eval was silent ~10 s ("spec-eval: trained draft, 40/100 prompts, 1,234
    rounds, 12 s"): a count per prompt, a line every ~10 s at most, none of the eval's figures touched."""

    def __init__(self, beat: Heartbeat, drafts: int, show: Callable[[float, str], None]):
        self.beat = beat
        self.drafts = drafts  # each draft's pass over its prompts, then each benchmark's
        self.show = show  # (percent, description) to the progress artifact
        self.seen: list[str] = []
        self.done = self.total = self.rounds = 0
        beat.doing("spec-eval: starting the eval process (importing torch, loading the target and the draft)")

    def on_message(self, message: Message) -> None:
        name, done, total = (message.values[k] for k in ("draft", "done", "total"))
        if name not in self.seen:  # a new pass: its own counts and seconds
            self.seen.append(name)
            self.rounds = 0
            self.beat.doing(functools.partial(self.status, self.what(name)))
        self.done, self.total = done, total
        self.rounds += message.values.get("rounds", 0)
        progress = 100.0 * (len(self.seen) - 1 + done / total) / self.drafts
        self.show(round(progress, 1), f"eval: {self.what(name)}, {done}/{total} prompts")

    @staticmethod
    def what(name: str) -> str:
        return f"benchmark {name.split(':', 1)[1]}" if ":" in name else f"{name} draft"

    def status(self, what: str, seconds: float) -> str:
        line = f"spec-eval: {what}, {self.done}/{self.total} prompts, {self.rounds:,} rounds, {seconds:.0f} s"
        if self.done == self.total and not what.startswith("benchmark"):
            line += " (decoded; now replaying its outputs through the draft)"
        return line


@task(name="engine-eval", cache_policy=NO_CACHE)
def evaluate_on_server(
    job: EvalJobFile, engine: ServedEvalSettings, server: EvalServer, config_name: str
) -> dict[str, Any]:
    """Engine backend (tasks/serving/eval_server.py, tasks/eval/engine_report.py): the eval prompts through the serving
    engine with the draft served, then without."""
    logger = get_run_logger()
    with Heartbeat(logger.info) as beat:  # a line every ~10 s while a server loads or a phase decodes in silence
        return engine_eval(job, engine, server, config_name, logger, beat)


def engine_eval(
    job: EvalJobFile, engine: ServedEvalSettings, server: EvalServer, config_name: str, logger: Any, beat: Heartbeat
) -> dict[str, Any]:
    """`evaluate_on_server`'s work, `beat` told each step (a server's start and stop, each phase's prompts)."""
    from models.target.tokenizer import load_tokenizer

    final = _exported(job)
    if server.launch == "command":
        check_command(server.command)
    tokenizer = load_tokenizer(job.target.path, job.target.trust_remote_code)
    vocab_size = int(read_export_config(final)[0]["vocab_size"])  # either format (models/export/speculators.py)
    prompts = eval_prompts(job, vocab_size)
    if not prompts:
        raise ValueError(f"no eval prompts (train.eval_fraction={job.eval_fraction}): raise eval_fraction and retrain")
    params = request_sampling_params(
        {"max_new_tokens": job.max_new_tokens, "temperature": 0.0}, default_stop_ids(tokenizer)
    )
    artifact = progress_artifact(
        progress=0.0,
        key=artifact_key("eval-engine", config_name),
        description="engine eval: starting the server with the draft",
    )
    benchmarks = benchmark_prompts(job, vocab_size)
    baseline = engine.baseline and (server.launch != "none" or engine.baseline_url)
    phases = 1 + len(benchmarks) + (1 if baseline else 0)  # the draft's, each benchmark's (with it), the baseline

    def measure(
        url: str,
        chosen: list,
        phase: int,
        what: str,
        select: Callable[..., Any] | None = None,
        sampling: dict[str, Any] | None = None,
        watch: ServerWatch | None = None,
    ) -> Phase:
        count = {"done": 0, "total": len(chosen)}  # `select` may send fewer: on_done says how many

        async def on_done(done: int, total: int) -> None:
            count.update(done=done, total=total)
            await aupdate_progress_artifact(
                artifact,
                progress=round(100.0 * (phase + done / total) / phases, 1),
                description=f"engine eval: {what}, {done}/{total} prompts",
            )

        s = server.settings
        beat.doing(lambda seconds: f"engine eval: {what}, {count['done']}/{count['total']} prompts, {seconds:.0f} s")
        return run_coro_as_sync(
            decode_prompts(
                url,
                chosen,
                sampling or params,
                engine=server.engine,
                concurrency=engine.concurrency,
                retry=RetryPolicy(outage_window_s=s.outage_window_s),
                request_timeout_s=s.request_timeout_s,
                api_key=s.api_key(),
                auth_hint=auth_hint(s),
                vocab_size=vocab_size,
                on_done=on_done,
                select=select,
                logger=logger,
                watch=watch,
            )
        )

    def draft_prompts(limits, client):
        client.check_draft(limits, job.num_steps)
        return fit_draft_context(prompts, limits, job.max_new_tokens)

    spec = server.speculative_args(str(final), job.num_steps)
    with server.serving(spec, "eval-with-draft", logger, beat) as launched:
        watch = server.watch(launched)  # a launched server that dies ends the eval at once, quoting its log
        with_draft = measure(server.settings.url, prompts, 0, "with the draft", select=draft_prompts, watch=watch)
        on_benchmarks = {}
        for i, b in enumerate(job.benchmarks):  # each with its own generation length, left out like the eval prompts
            n = b.max_new_tokens or job.max_new_tokens
            chosen = benchmarks[b.name]
            on_benchmarks[b.name] = measure(
                server.settings.url,
                chosen,
                1 + i,
                f"benchmark {b.name} with the draft",
                select=lambda limits, client, chosen=chosen, n=n: fit_draft_context(chosen, limits, n),
                sampling=request_sampling_params(
                    {"max_new_tokens": n, "temperature": 0.0}, default_stop_ids(tokenizer)
                ),
                watch=watch,
            )
    if with_draft.skipped:
        logger.warning(
            "engine eval: %d prompt(s) left out of both phases: too long for the draft server's reserved tokens "
            "(first: %s)",
            len(with_draft.skipped),
            next(iter(with_draft.skipped.values())),
        )
    if any(s.spec_verify_ct is None for s in with_draft.served):
        raise ValueError(
            f"{server.settings.url} sent replies without their verify rounds: it is not decoding with the draft "
            + (
                "(vLLM: started without --speculative-config, or without --per-request-spec-decode-metrics)"
                if server.engine == "vllm"
                else "(or is an SGLang too old to send meta_info.spec_verify_ct)"
            )
        )
    without = None
    if baseline:  # the same prompts as the draft phase served, so that the speedup compares like with like
        served = {(r.source, r.id) for r in with_draft.served}
        with server.serving([], "eval-without-draft", logger, beat) as launched:
            without = measure(
                engine.baseline_url or server.settings.url,
                [p for p in prompts if (p.source, p.id) in served],
                phases - 1,
                "without the draft",
                watch=server.watch(launched),
            )
    report = engine_report(
        with_draft, without, job.num_steps, engine.concurrency, server.engine, context_edges=job.context_buckets
    )
    if on_benchmarks:  # completion tokens / verify rounds per benchmark, as SpecForge's bench_eagle3 counts
        report["benchmarks"] = {
            name: {
                **acceptance(phase.served),
                **context_of(phase.served, job.context_buckets),
                "refused": phase.refused,
                "skipped": phase.skipped,
            }
            for name, phase in on_benchmarks.items()
        }
    overall = report["overall"]
    speedup = f", speedup {overall['speedup']:.2f}x" if overall.get("speedup") else ""
    logger.info(
        "engine eval (%s): acceptance length %s (completion tokens / verify rounds, as SGLang counts), %s per round, "
        "over %d prompts%s",
        server.engine,
        overall["acceptance_length"],
        overall["per_round"],
        overall["prompts"],
        speedup,
    )
    if "by_context" in overall:
        logger.info(
            "engine eval (%s): acceptance length by context position (each verify round where it starts, placed by "
            "%s: docs/run-a-pipeline.md, Acceptance by context position): %s",
            server.engine,
            overall["placed_by"] or "-",
            context_text(overall["by_context"]),
        )
        if overall.get("unplaced"):
            logger.info(
                "engine eval: the rounds of %d of %d prompt(s) are not in the buckets (first: %s)",
                len(overall["unplaced"]),
                overall["prompts"],
                next(iter(overall["unplaced"].items())),
            )
    update_progress_artifact(
        artifact, progress=100.0, description=f"engine eval: acceptance length {overall['acceptance_length']}{speedup}"
    )
    return report


@task(name="eval-report", cache_policy=NO_CACHE)
def publish_eval(
    job: EvalJobFile,
    hf: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    config_name: str,
    report_path: Path,
    train_dir: Path | None,
) -> dict[str, Any]:
    """eval.json at `report_path`, and the eval-summary table artifact: each backend that ran, side by side.

    `train_dir`: the draft directory of the training that made the draft (its held-out metrics give the
    training-time estimate), or None for a draft trained elsewhere.
    """
    final = Path(job.draft_dir)
    report: dict[str, Any] = {
        "num_steps": job.num_steps,
        "max_new_tokens": job.max_new_tokens,
        "draft": str(final),
        "backends": [name for name, r in (("hf", hf), ("engine", engine)) if r is not None],
    }
    if hf is not None:
        report.update({k: v for k, v in hf.items() if k != "benchmarks"})
    if engine is not None:
        report["engine"] = engine
        report.setdefault("prompts", engine["overall"]["prompts"])
        if hf is not None:
            report["engine_vs_hf"] = compare_with_hf(engine, hf["trained"])
    measured = measured_value(report)
    report["ttt_estimate"] = ttt_estimate(train_dir, job.num_steps)
    report["estimates"] = estimates(
        train_dir, job.num_steps, measured, hf["trained"].get("replay") if hf is not None else None
    )
    if job.benchmarks:
        report["benchmarks"] = benchmark_section(job, hf, engine)
    report["sglang_command"] = sglang_command(job.target.path, final, job.num_steps, job.target.trust_remote_code)
    report["vllm_command"] = vllm_command(job.target.path, final, job.num_steps, job.target.trust_remote_code)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(report_path, json.dumps(report, indent=2))
    create_table_artifact(
        table=eval_rows(report),
        key=artifact_key("eval-summary", config_name),
        description=f"Acceptance length at {job.num_steps} draft tokens per round (SGLang topk 1), greedy "
        f"target, {report['prompts']} eval prompts. 'measured' rows: speculative decoding "
        "on the eval prompts (in-process HF, or the serving engine's meta_info); "
        "'training-time estimate': the chain formula over the held-out "
        "TTT accept rates at the same number of steps, teacher-forced on training records "
        "(a different text and weighting; docs/acceptance.md, 'Two acceptance numbers')",
    )
    if job.benchmarks:
        create_table_artifact(
            table=benchmark_rows(report["benchmarks"]),
            key=artifact_key("eval-benchmarks", config_name),
            description=f"Published benchmarks with the trained draft at {job.num_steps} steps, top-k 1, "
            f"{job.num_steps + 1} draft tokens, greedy target: acceptance length as SpecForge's bench_eagle3 counts "
            "it (completion tokens / verify rounds; the HF backend's, else the engine's; 'engine': the engine's "
            "beside the HF one), per verify round without the prefill's token, and the acceptance length published "
            "for this target (data/benchmarks/anchors.json, or the entry's anchor). Comparable only for the same "
            "target, prompts and generation length (docs/acceptance.md, Benchmarks and published anchors)",
        )
    if context_rows(report):
        create_table_artifact(
            table=context_rows(report),
            key=artifact_key("eval-context", config_name),
            description="Acceptance length by context position (models/eval/context.py): each verify round in the "
            "bucket of the tokens before its first draft token (prompt and answer so far), "
            f"edges {job.context_buckets}; per draft on the eval prompts, and the trained draft on each benchmark, "
            "measured in-process, and the trained draft's rounds as the serving engine counted them (named "
            "'<source> (<engine>)': each round from vLLM's per-round counts; from SGLang, which sends a request's "
            "totals, the requests whose rounds all start in one bucket)",
        )
    if engine is not None:
        create_table_artifact(
            table=engine_rows(engine),
            key=artifact_key("eval-engine-summary", config_name),
            description="Engine eval per dataset: acceptance length as SGLang counts it (completion tokens "
            "/ verify rounds) and per verify round (as the HF eval counts), the per-request "
            "spread, decode tokens/s with and without the draft, and the speedup",
        )
    return report


def measured_value(report: dict[str, Any]) -> float | None:
    """The trained draft's measured acceptance length per verify round: the HF backend's, else the engine's."""
    if "trained" in report:
        return report["trained"]["acceptance_length"]
    engine = report.get("engine")
    return engine["overall"]["per_round"] if engine else None


def _exported(job: EvalJobFile) -> Path:
    final = Path(job.draft_dir)
    if not (final / "config.json").is_file():
        raise FileNotFoundError(
            f"{final}: no draft there (no config.json); for the run's own draft (eval.draft final or best) run the "
            "train stage first (eagle3 run CONFIG --stages train), else give the directory of an EAGLE-3 draft"
        )
    return final


def _training_cond_acc(draft_dir: Path | None) -> list[float] | None:
    """The held-out TTT eval's per-step conditional accept rates at the end of training, or None."""
    summary = draft_dir / TRAIN_SUMMARY if draft_dir is not None else None
    if summary is None or not summary.is_file():
        return None
    last = json.loads(summary.read_text()).get("eval")
    return list(last["per_step_cond_acc"]) if last else None


def ttt_estimate(draft_dir: Path | None, num_steps: int) -> dict[str, Any] | None:
    """The training-time estimate at the eval's chain length: the chain formula over the first num_steps
    held-out TTT rates (models/eval/estimates.py); None without a held-out eval or with fewer TTT steps."""
    cond = _training_cond_acc(draft_dir)
    if cond is None or len(cond) < num_steps:
        return None
    return {
        "acceptance_length": round(chain_acceptance_length(cond, num_steps), 4),
        "per_position_acceptance": cond[:num_steps],
        "note": f"training-time estimate at {num_steps} steps: held-out TTT metrics at the end of training "
        "(teacher-forced on held-out training records, every position a chain root), not a measurement",
    }


def estimates(
    draft_dir: Path | None, num_steps: int, measured: float | None, replay: dict[str, Any] | None = None
) -> dict[str, Any]:
    """eval.json's labelled figures at the eval's num_steps: the training-time estimate, the measured value,
    the replay."""
    return estimates_block(num_steps, training_cond_acc=_training_cond_acc(draft_dir), measured=measured, replay=replay)


MEASURED_ROW = "{name}: measured (speculative decoding)"
ENGINE_ROW = "trained: measured by the serving engine, per verify round (as the HF eval counts)"
ENGINE_SGLANG_ROW = (
    "trained: measured by the serving engine, SGLang's acceptance length (completion tokens / verify rounds)"
)
ESTIMATE_ROW = "trained: training-time estimate (teacher-forced, held-out records)"


def eval_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-summary table: measured rows per draft (HF backend), the engine's, then the trained draft's
    training-time estimate at the same num_steps."""
    rows = []
    for name in ("untrained", "trained"):
        if name in report:
            r = report[name]
            rows.append(
                {
                    "draft": MEASURED_ROW.format(name=name),
                    "acceptance_length": r["acceptance_length"],
                    **{f"pos_{i + 1}": a for i, a in enumerate(r["per_position_acceptance"])},
                    "rounds": r["rounds"],
                    "tokens": r["new_tokens"],
                }
            )
    if report.get("engine"):
        o = report["engine"]["overall"]
        rows.append(
            {
                "draft": ENGINE_ROW,
                "acceptance_length": o["per_round"],
                "rounds": o["verify_rounds"],
                "tokens": o["completion_tokens"],
            }
        )
        rows.append(
            {
                "draft": ENGINE_SGLANG_ROW,
                "acceptance_length": o["acceptance_length"],
                "rounds": o["verify_rounds"],
                "tokens": o["completion_tokens"],
            }
        )
    if report.get("ttt_estimate"):
        e = report["ttt_estimate"]
        rows.append(
            {
                "draft": ESTIMATE_ROW,
                "acceptance_length": e["acceptance_length"],
                **{f"pos_{i + 1}": round(a, 4) for i, a in enumerate(e["per_position_acceptance"])},
                "rounds": None,
                "tokens": None,
            }
        )
    return rows


def context_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-context table: one row per context-position bucket that holds rounds, the acceptance length of each
    source in it (in-process: the eval prompts per draft, then each benchmark with the trained draft; the engine's
    where it sent per-round counts, named `<source> (<engine>)`) and the trained draft's rounds on the eval prompts
    (the engine's without an in-process eval). [] when nothing measured them."""
    sources = {n: report[n]["by_context"] for n in ("trained", "untrained") if "by_context" in report.get(n, {})}
    engine = report.get("engine") or {}
    if "by_context" in engine.get("overall", {}):
        sources[f"trained ({engine['engine']})"] = engine["overall"]["by_context"]
    for name, b in (report.get("benchmarks") or {}).items():
        if "by_context" in b.get("hf", {}):
            sources[name] = b["hf"]["by_context"]
        if "by_context" in b.get("engine", {}):
            sources[f"{name} ({engine.get('engine', 'engine')})"] = b["engine"]["by_context"]
    buckets = sorted({(c["from"], c["label"]) for cs in sources.values() for c in cs})
    rows = []
    for start, label in buckets:
        row: dict[str, Any] = {"context": label}
        for name, cs in sources.items():
            found = next((c for c in cs if c["from"] == start), None)
            if name == "trained" or (name.startswith("trained (") and "trained" not in sources):
                row["rounds"] = found["rounds"] if found else 0
            row[name] = found["acceptance_length"] if found else None
        rows.append(row)
    return rows


def engine_rows(engine: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-engine-summary table: one row per dataset, then all of them."""
    rows = []
    for name, r in [*engine["datasets"].items(), ("all", engine["overall"])]:
        spread = r["per_request"] or {}
        rows.append(
            {
                "dataset": name,
                "prompts": r["prompts"],
                "acceptance_length": r["acceptance_length"],
                "per_round": r["per_round"],
                "per_request_p10": spread.get("p10"),
                "per_request_median": spread.get("median"),
                "per_request_p90": spread.get("p90"),
                "tok_s_with_draft": r["with_draft"]["tokens_per_s"],
                "tok_s_without": r.get("without_draft", {}).get("tokens_per_s"),
                "speedup": r.get("speedup"),
            }
        )
    return rows


def sglang_command(target_path: str, draft_dir: Path, num_steps: int, trust_remote_code: bool, tp: int = 8) -> str:
    """The SGLang launch that serves the target with this draft (REFERENCE: EAGLE3, top-k 1)."""
    launch = ["python", "-m", "sglang.launch_server", "--model-path", target_path, "--tp", str(tp)]
    return _with_draft(launch, SGLangClient.speculative_args(str(draft_dir), num_steps), trust_remote_code)


def vllm_command(target_path: str, draft_dir: Path, num_steps: int, trust_remote_code: bool, tp: int = 8) -> str:
    """The vLLM launch that serves the target with this draft, with per-request verify counts
    (tasks/serving/vllm.py)."""
    launch = ["vllm", "serve", target_path, "--tensor-parallel-size", str(tp)]
    return _with_draft(launch, VLLMClient.speculative_args(str(draft_dir), num_steps), trust_remote_code)


def _with_draft(launch: list[str], speculative: list[str], trust_remote_code: bool) -> str:
    """The launch line with the draft's flags (and --trust-remote-code where the target needs it), shell-quoted."""
    return shlex.join([*launch, *speculative, *(["--trust-remote-code"] if trust_remote_code else [])])
