"""`eagle3`: the command line of eagle3-pipeline."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, cast

import typer
from rich.console import Console
from rich.markup import escape

from settings.stages import NODE_STAGES, STAGES, Stage, UnknownStage, parse_stages


class Eagle3(typer.Typer):
    """The `eagle3` app. Called as a program (the console script calls `app()`; `main`), it flushes its output line by
    line (a log file shows each line when it is printed), and SIGTERM or SIGINT stop every child of a command, then
    the command, within seconds (tasks/runtime/stopping.py). Tests that invoke it in-process (CliRunner) get neither."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tasks.runtime import stopping

        _flush_per_line()
        try:
            with stopping.stop_on_signals():
                return super().__call__(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt):
            stopped = stopping.signalled()
            if stopped is None:
                raise
            signum, after_s = stopped
            _say(
                f"eagle3: stopped by {signal.Signals(signum).name} in {after_s:.1f} s: the servers, rank jobs and "
                "Prefect server it started are stopped; what was checkpointed is kept: run the same command again "
                "to resume"
            )
            stopping.exit_now(128 + signum)


app = Eagle3(
    name="eagle3",
    help="Turn prompt datasets into a trained EAGLE-3 draft for a target served by SGLang or vLLM.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Tables are wide: when the output is a file or a pipe (logs, CI), do not squeeze them to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


@app.command()
def demo(
    run_dir: Path | None = typer.Option(
        None,
        help="Where the demo run goes (default: one per target and engine in the repository's runs/: runs/demo for the "
        "llama target through the dev server, else runs/demo[-TARGET][-ENGINE], e.g. runs/demo-vllm, runs/demo-kimi; "
        "a run directory another engine or target made is refused).",
    ),
    capture_backend: str = typer.Option(
        "deepspeed",
        "--capture-backend",
        metavar="deepspeed|vllm",
        help="vllm: capture through a real vLLM (its CPU build, `make vllm`) that extracts the hidden states "
        "(extract_hidden_states with the project's connector, deploy/vllm-plugins), instead of DeepSpeed ranks.",
    ),
    engine: str | None = typer.Option(
        None,
        "--engine",
        metavar="dev|sglang|vllm",
        help="dev: generate and the engine eval through the dev server, which emulates SGLang; sglang: the same "
        "through a real SGLang 0.5.23, its own EAGLE-3 worker serving the draft (`make sglang` installs it for CPU "
        "in .venv-sglang, with labelled kernel stand-ins); vllm: the same through a real vLLM (`make vllm` installs "
        "its CPU build in .venv-vllm). Default: dev for the llama target, vllm for the kimi ones.",
    ),
    target: str = typer.Option(
        "llama",
        "--target",
        metavar="llama|kimi|kimi-long|kimi-int4",
        help="kimi: the Kimi-K2.5-shaped tiny target (a kimi_k25 checkpoint: MLA, MoE, YaRN; configs/demo-kimi.yaml) "
        "instead of the tiny Llama (configs/demo.yaml); kimi-long: the same target trained on a book, which answers "
        "at length (100 to ~2,100 tokens), and the eval by context position on its answers "
        "(configs/demo-kimi-long.yaml; its target takes ~17 min to build); kimi-int4: the kimi target as Kimi-K2.5 "
        "is published, its routed experts INT4 (configs/demo-kimi-int4.yaml: the dev server serves it, DeepSpeed "
        "captures it without a dense copy).",
    ),
    draft_arch: str = typer.Option(
        "llama",
        "--draft-arch",
        metavar="llama|mla",
        help="llama: the preset's Llama-style draft; mla: the MLA draft (train.draft_arch: mla, a kimi target only), "
        "in a run directory of its own (runs/demo-kimi-mla, runs/demo-kimi-sglang-mla).",
    ),
) -> None:
    """Run the pipeline on the embedded default: tiny target, dev server (or a real SGLang or vLLM), sample data."""
    from cli.demo_targets import DEMO_TARGETS, check_demo_engine

    if target not in DEMO_TARGETS:
        err.print(
            f"[red]error:[/red] --target must be one of {', '.join(DEMO_TARGETS)}, got {escape(target)!r}",
            highlight=False,
        )
        raise typer.Exit(2)
    engine = engine or DEMO_TARGETS[target].engine

    if capture_backend not in ("deepspeed", "vllm"):
        err.print(
            f"[red]error:[/red] --capture-backend must be deepspeed or vllm, got {escape(capture_backend)!r}",
            highlight=False,
        )
        raise typer.Exit(2)
    try:
        check_demo_engine(engine, target, draft_arch)
        if capture_backend == "vllm":
            check_demo_engine("vllm", target)
    except (ValueError, FileNotFoundError) as e:
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        raise typer.Exit(2) from None
    from cli.demo import run_demo
    from tasks.generate.provenance import OtherEngine
    from tasks.runtime.prefect_api import prefect_api

    try:
        # Prefect's API once the arguments are checked (a refused one starts no server), as run, generate and eval
        with prefect_api(say=_say):
            run_demo(
                run_dir=run_dir,
                console=console,
                capture_backend=capture_backend,
                engine=engine,
                target=target,
                draft_arch=draft_arch,
            )
    except OtherEngine as exc:  # the run directory's responses are another engine's or target's
        err.print(f"[red]refused:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None


@app.command()
def validate(config: Path = typer.Argument(..., help="The YAML run config to check.")) -> None:
    """Check a run config and every dataset file it names; print a table of the datasets."""
    from cli.validate import validate_datasets

    cfg = _config_or_exit(config)
    ok = validate_datasets(cfg, config_path=config, console=console)
    raise typer.Exit(0 if ok else 1)


SKIP_CHECKS_HELP = "Do not run the preflight checks (`eagle3 doctor`'s) before the first stage; said in the log."

RETRY_REJECTS_HELP = (
    "Also send again the prompts the server refused with HTTP 400 in earlier runs (bad rows and prompts "
    "rejected as too long are always checked again)."
)


@app.command()
def generate(
    config: Path = typer.Argument(..., help="The YAML run config."),
    retry_rejects: bool = typer.Option(False, "--retry-rejects", help=RETRY_REJECTS_HELP),
    skip_checks: bool = typer.Option(False, "--skip-checks", help=SKIP_CHECKS_HELP),
) -> None:
    """Stage 1: generate responses for every dataset (same as `run CONFIG --stages generate`)."""
    _run_stages(config, ["generate"], retry_rejects=retry_rejects, skip_checks=skip_checks)


@app.command("eval")
def eval_(
    config: Path = typer.Argument(..., help="The YAML run config (its train stage must have exported a draft)."),
    draft: str | None = typer.Option(
        None,
        "--draft",
        help="final, best, or the directory of any EAGLE-3 draft for this target (ours, SGLang-style, speculators "
        "format); default eval.draft. Another draft's report: RUN_DIR/evals/<name>-<hash of its path>/eval.json.",
    ),
    skip_checks: bool = typer.Option(False, "--skip-checks", help=SKIP_CHECKS_HELP),
) -> None:
    """Stage 5: acceptance length of the exported draft with the target (same as `run CONFIG --stages eval`)."""
    _run_stages(config, ["eval"], skip_checks=skip_checks, eval_draft=draft)


@app.command("export")
def export(
    config: Path = typer.Argument(..., help="The YAML run config (its target is the draft's target)."),
    to: str = typer.Option("speculators", "--format", help="speculators | sglang: the format written."),
    draft: str = typer.Option("final", "--draft", help="final, best, or the directory of any EAGLE-3 draft."),
    out: Path | None = typer.Option(None, "--out", help="Where to write it (default: RUN_DIR/draft/<format>)."),
) -> None:
    """Write a draft in another format, the tensors unchanged: `speculators` (`vllm serve OUT` serves the target with
    it, no other flag) or `sglang` (our export: SGLang's and vLLM's --speculative-* flags). Reads either format."""
    from cli.export import export_draft_as

    cfg = _config_or_exit(config)
    try:
        written = export_draft_as(cfg, draft, to, out)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    console.print(f"wrote {escape(str(written))} ({to} format)", highlight=False)
    if to == "speculators":
        console.print(f"serve it: vllm serve {escape(str(written))}", highlight=False)


@app.command()
def doctor(config: Path = typer.Argument(..., help="The YAML run config to check.")) -> None:
    """Check a config before a run, in seconds: environment, engine, chat template, draft, disk, run directory.

    A table of checks, each PASS, WARN or FAIL with what to do. Exit status: 0 no FAIL; 1 a check failed; 2 bad config.
    The pipeline runs the same checks before its first stage (--skip-checks skips them).
    """
    from cli.doctor import print_doctor

    cfg = _config_or_exit(config)
    raise typer.Exit(0 if print_doctor(cfg, config, console) else 1)


@app.command()
def run(
    config: Path = typer.Argument(..., help="The YAML run config."),
    stages: str = typer.Option(",".join(STAGES), help=f"Comma-separated stages to run, of: {', '.join(STAGES)}."),
    retry_rejects: bool = typer.Option(False, "--retry-rejects", help=RETRY_REJECTS_HELP),
    skip_checks: bool = typer.Option(False, "--skip-checks", help=SKIP_CHECKS_HELP),
) -> None:
    """Run the pipeline's stages on a config (each stage resumes where it stopped; the preflight checks first)."""
    try:
        chosen = parse_stages(stages)
    except UnknownStage as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    _run_stages(config, chosen, retry_rejects=retry_rejects, skip_checks=skip_checks)


def _run_stages(
    config: Path,
    stages: list[Stage],
    *,
    retry_rejects: bool = False,
    skip_checks: bool = False,
    eval_draft: str | None = None,
) -> None:
    from settings.layout import RUN_DRAFTS

    cfg = _config_or_exit(config)  # fail on a bad config before Prefect starts
    if eval_draft is not None and eval_draft not in RUN_DRAFTS:
        eval_draft = str(Path(eval_draft).resolve())
        if not (Path(eval_draft) / "config.json").is_file():
            err.print(f"[red]error:[/red] --draft {escape(eval_draft)}: no config.json there (not a draft)")
            raise typer.Exit(2)
    from flows.stage_run import held_run
    from tasks.runtime.prefect_api import prefect_api
    from tasks.runtime.run_lock import RunDirLocked

    try:
        # Taken here, once: a second writer is refused before a Prefect server starts, and no flow run is created
        # for it; the pipeline and its stage flows find the config loaded and the lock held (flows/stage_run.py).
        with (
            held_run(config, stages, f"eagle3 {','.join(stages)}", config=cfg),
            prefect_api(say=_say),
        ):
            from flows.pipeline import pipeline

            pipeline(str(config), ",".join(stages), retry_rejects, skip_checks, eval_draft)
    except RunDirLocked as exc:
        err.print(f"[red]refused:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    except Exception as exc:  # the flow run's log has the details
        err.print(f"[red]pipeline failed:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    _print_stats(cfg.run_dir, as_json=False)
    if "eval" in stages:
        from cli.demo import render_eval

        report = cfg.layout.eval_of(eval_draft or cfg.eval.draft)[1]
        console.print(render_eval(report))
        console.print(f"eval report: {escape(str(report))}", highlight=False)


@app.command()
def plan(config: Path = typer.Argument(..., help="The YAML run config.")) -> None:
    """What every stage still has to do: tokens, disk bytes against free space, time when known."""
    from cli.plan import print_plan

    raise typer.Exit(0 if print_plan(_config_or_exit(config), console) else 1)


@app.command()
def stats(
    run_dir: Path = typer.Argument(..., help="A run directory (run_dir of a config)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Per-dataset table of a run from Parquet footers only (fast, safe during a run); exit 1 if a part is damaged."""
    if not run_dir.is_dir():
        err.print(
            f"[red]error:[/red] {escape(str(run_dir))} is not a directory (give the run_dir of a config)",
            highlight=False,
        )
        raise typer.Exit(2)
    raise typer.Exit(0 if _print_stats(run_dir, as_json=as_json) else 1)


def _print_stats(run_dir: Path, *, as_json: bool) -> bool:
    """Print the stats of a run; False when a damaged part kept a dataset out (it is named, not raised)."""
    import json

    from tasks.records.build import record_stats
    from tasks.responses.stats import collect_stats, render_rows_table, render_stats_table, stats_rows

    collected = collect_stats(run_dir)
    damaged_records: list[str] = []
    records = [r.row() for r in record_stats(run_dir, on_damaged=lambda name, exc: damaged_records.append(str(exc)))]
    damaged = [s.damaged for s in collected if s.damaged] + damaged_records
    if as_json:
        print(json.dumps({"responses": stats_rows(collected), "records": records, "damaged": damaged}, indent=2))
        return not damaged
    console.print(render_stats_table(collected))
    if records:
        console.print(render_rows_table("training records per dataset", records))
    for line in damaged_records:  # damaged response parts are named under the responses table
        err.print(f"[red]damaged:[/red] {escape(line)}", highlight=False)
    return not damaged


@app.command("import-jsonl")
def import_jsonl(
    run_dir: Path = typer.Argument(
        ...,
        help="The run directory to import into (its config.yaml names the target tokenizer; "
        "with --target it may be new).",
    ),
    dataset: str = typer.Argument(..., help="Dataset name (directory under responses/)."),
    file: Path = typer.Argument(..., help="A legacy raw_responses.jsonl."),
    target: str | None = typer.Option(
        None, help="Target tokenizer path (default: target.path of RUN_DIR/config.yaml)."
    ),
    on_bad_line: str = typer.Option(
        "fail",
        "--on-bad-line",
        metavar="fail|skip",
        help="fail: a bad line stops the import, naming it, and nothing of FILE is imported. skip: bad lines are "
        "counted and listed in RUN_DIR/rejects/DATASET/ (stage 'import'), the other lines are imported.",
    ),
) -> None:
    """Adopt a legacy raw_responses.jsonl (nested usage.completion_tokens or flat completion_tokens) as checkpoints.

    All or nothing per file: every line is checked before any is added.

    Ids already in RUN_DIR/responses/DATASET/ are skipped: a rerun (after a fix, a kill or a full disk) adds each
    response once.

    Exit status: 0 done; 2 bad input (file and line named); 1 another writer holds RUN_DIR, a write failed or a part
    there is damaged.
    """
    from typing import NoReturn

    from flows.config.file import ConfigError, load_config
    from settings.dataset import DATASET_NAME
    from settings.layout import RunLayout
    from tasks.generate.legacy_import_run import ImportFailed, import_legacy_file

    def fail(message: str, code: int, label: str = "error") -> NoReturn:
        err.print(f"[red]{label}:[/red] {escape(message)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code)

    if on_bad_line not in ("fail", "skip"):
        fail(f"--on-bad-line must be fail or skip, got {on_bad_line!r}", 2)
    if not DATASET_NAME.match(dataset):
        fail(
            f"dataset {dataset!r} cannot be a directory name: "
            "use letters, digits, '_', '.', '-' and start with a letter or digit",
            2,
        )
    if not file.is_file():
        fail(f"{file}: {'is not a file' if file.exists() else 'no such file'}", 2)
    if run_dir.exists() and not run_dir.is_dir():
        fail(f"{run_dir} is not a directory: give the run directory to import into", 2)
    layout = RunLayout(run_dir)
    trust = False
    if target is None:
        if not run_dir.is_dir():
            fail(
                f"{run_dir} does not exist: check the path, or pass --target PATH to import into a new run directory", 2
            )
        try:
            cfg = load_config(layout.config)
        except ConfigError as exc:
            err.print(
                f"[red]error:[/red] cannot tell the target tokenizer: {escape(str(exc))}\nPass --target PATH.",
                highlight=False,
            )
            raise typer.Exit(2) from None
        target, trust = cfg.target.path, cfg.target.trust_remote_code
        if dataset not in {d.name for d in cfg.datasets}:  # a typo would import where no stage looks
            err.print(
                f"[yellow]note:[/yellow] {escape(str(layout.config))} has no dataset {escape(dataset)!r} "
                f"(it has: {escape(', '.join(d.name for d in cfg.datasets))}); stages see these responses only "
                "under a dataset of that name",
                highlight=False,
                soft_wrap=True,
            )
    new_run_dir = not run_dir.exists()
    try:
        report = import_legacy_file(
            run_dir,
            dataset,
            file,
            target=target,
            trust_remote_code=trust,
            on_bad_line="skip" if on_bad_line == "skip" else "fail",  # fail or skip, checked above
        )
    except ImportFailed as exc:
        fail(str(exc), exc.code, exc.label)
    console.print(escape(report.summary()), highlight=False, soft_wrap=True)
    if new_run_dir:
        console.print(f"created the run directory {escape(str(run_dir))}", highlight=False)


@app.command()
def node(
    config: Path = typer.Argument(
        ..., help="The YAML run config node 0 runs (RUN_DIR on a filesystem every node shares)."
    ),
    node_rank: int = typer.Option(
        ..., "--node-rank", help="This node's rank, 1..distributed.nnodes-1 (node 0 runs the pipeline)."
    ),
    stages: str = typer.Option(
        ",".join(NODE_STAGES), help="Comma-separated stages to join, in order, of: capture, train."
    ),
) -> None:
    """On a node other than 0: run its ranks of node 0's capture and train jobs (torchrun, distributed.nnodes > 1)."""
    from models.common.rank_protocol import CAPTURE, TRAIN
    from tasks.runtime.launch_ranks import resolve_launcher, run_node

    cfg = _config_or_exit(config)
    try:
        chosen = parse_stages(stages, NODE_STAGES)
    except UnknownStage:
        chosen = []
    problem = None
    if not cfg.distributed.multinode:
        problem = f"{config}: distributed.nnodes is 1: capture and train run on the pipeline's node alone"
    elif not chosen:
        problem = f"--stages {stages!r}: give capture, train or both"
    elif not 1 <= node_rank < cfg.distributed.nnodes:
        problem = (
            f"--node-rank {node_rank}: this node's rank is 1..{cfg.distributed.nnodes - 1} (node 0 runs the pipeline)"
        )
    else:
        launchers = {s: resolve_launcher(getattr(cfg, s).launcher) for s in chosen}
        if "deepspeed" in launchers.values():
            problem = (
                f"{', '.join(s for s, how in launchers.items() if how == 'deepspeed')}: "
                "the deepspeed launcher starts every node's ranks from node 0 over ssh (distributed.hostfile); "
                "run nothing on the other nodes"
            )
    if problem:
        err.print(f"[red]error:[/red] {escape(problem)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    modules = {"capture": ("models.capture", CAPTURE), "train": ("models.train", TRAIN)}
    for stage in chosen:
        section = getattr(cfg, stage)
        module, protocol = modules[stage]
        try:
            run_node(
                module,
                cfg.layout.job(stage),
                protocol=protocol,
                num_ranks=section.num_gpus,
                launcher=section.launcher,
                nodes=cfg.distributed,
                node_rank=node_rank,
                attempts=section.retries + 1,
                log=lambda line: print(line, flush=True),
            )
        except Exception as exc:  # noqa: BLE001 - the job's failure, in its words; node 0 has the same verdict
            err.print(
                f"[red]error:[/red] node {node_rank}: {escape(stage)} failed: {escape(str(exc))}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None
        console.print(f"node {node_rank}: {stage} done", highlight=False)


@app.command("tiny-target")
def tiny_target(
    out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer to."),
    shape: str = typer.Option(
        "llama",
        "--shape",
        metavar="llama|kimi|kimi-long",
        help="llama: a tiny Llama; kimi: Kimi-K2.5's shape, a tiny DeepSeek-V3 (MLA, MoE, YaRN) saved as a "
        "kimi_k25 checkpoint; kimi-long: the kimi target trained further on a book, so that it answers at length "
        "(models/target/book.py).",
    ),
    seed: int = typer.Option(0, help="Seed of the initial weights and of the training's data order."),
    num_layers: int = typer.Option(8, help="Decoder layers (at least 8, so the EAGLE-3 aux layers are distinct)."),
    hidden_size: int = typer.Option(None, help="Hidden size (default: 128 for llama, 256 for kimi)."),
    train_steps: int = typer.Option(
        None, help="Training steps on the sample data (default: the demo's; 0: random weights)."
    ),
    quantize: str = typer.Option(
        None,
        "--quantize",
        metavar="int4",
        help="int4 (kimi shapes): publish it as Kimi-K2.5 is, the routed experts compressed-tensors pack-quantized "
        "int4 in groups of 32 (models/target/int4.py); the float32 build is made in a temp dir first.",
    ),
) -> None:
    """Build a deterministic tiny target (BPE tokenizer, Kimi-style chat template, briefly trained on the samples)."""
    from models.target.tiny import QUANTIZE, SHAPES, Quantize, build_target

    if shape not in SHAPES:
        err.print(
            f"[red]error:[/red] --shape must be one of {', '.join(SHAPES)}, got {escape(shape)!r}", highlight=False
        )
        raise typer.Exit(2)
    if quantize is not None and quantize not in QUANTIZE:
        err.print(
            f"[red]error:[/red] --quantize must be one of {', '.join(QUANTIZE)}, got {escape(quantize)!r}",
            highlight=False,
        )
        raise typer.Exit(2)
    given = {"hidden_size": hidden_size, "train_steps": train_steps}
    try:
        path = build_target(
            out_dir,
            shape,
            quantize=cast("Quantize | None", quantize),  # checked above
            seed=seed,
            num_layers=num_layers,
            **{k: v for k, v in given.items() if v is not None},
        )
    except ValueError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"tiny target written to {path}")


@app.command(
    "serve-dev",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def serve_dev(ctx: typer.Context) -> None:
    """Serve a small model over SGLang's native HTTP API on CPU (for the demo and tests); --help lists its flags.

    The flags are the dev server's own (`python -m emulators.dev_server`), declared there once.
    """
    from emulators.dev_server.cli import main

    main(ctx.args, prog="eagle3 serve-dev")


def _config_or_exit(path: Path):
    """The validated config at `path`; on any problem print them all and exit with status 2."""
    from flows.config.file import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        err.print(escape(str(exc)), style="red", highlight=False)
        raise typer.Exit(2) from None


def main() -> None:
    app()


def _flush_per_line() -> None:
    """Line-buffered stdout and stderr, also into a file or a pipe (Python buffers whole blocks there)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a replaced stream (a test's capture) may lack it
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _say(line: str) -> None:
    err.print(escape(line), highlight=False, soft_wrap=True)


if __name__ == "__main__":
    main()
