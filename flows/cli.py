"""`eagle3`: the command line of eagle3-pipeline."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(
    name="eagle3",
    help="Turn prompt datasets into a trained EAGLE-3 draft for a target served by SGLang.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Tables are wide: when the output is a file or a pipe (logs, CI), do not squeeze them to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 200)


@app.command()
def demo(
    run_dir: Optional[Path] = typer.Option(None, help="Where the demo run goes (default: runs/demo in the repository)."),
) -> None:
    """Run the pipeline on the embedded default: tiny target, dev server, sample data."""
    from flows.demo import run_demo

    run_demo(run_dir=run_dir, console=console)


@app.command()
def validate(config: Path = typer.Argument(..., help="The YAML run config to check.")) -> None:
    """Check a run config and every dataset file it names; print a table of the datasets."""
    from flows.validate import validate_datasets

    cfg = _config_or_exit(config)
    ok = validate_datasets(cfg, config_path=config, console=console)
    raise typer.Exit(0 if ok else 1)


STAGES = ("generate", "records", "capture", "train", "eval")  # in pipeline order (flows/pipeline.py)


@app.command()
def generate(config: Path = typer.Argument(..., help="The YAML run config.")) -> None:
    """Stage 1: generate responses for every dataset (same as `run CONFIG --stages generate`)."""
    _run_stages(config, ["generate"])


@app.command("eval")
def eval_(config: Path = typer.Argument(..., help="The YAML run config (its train stage must have exported a draft).")) -> None:
    """Stage 5: acceptance length of the exported draft by speculative decoding with the target (same as `run CONFIG --stages eval`)."""
    _run_stages(config, ["eval"])


@app.command()
def run(
    config: Path = typer.Argument(..., help="The YAML run config."),
    stages: str = typer.Option(",".join(STAGES), help=f"Comma-separated stages to run, of: {', '.join(STAGES)}."),
) -> None:
    """Run the pipeline's stages on a config (each stage resumes where it stopped)."""
    chosen = [s.strip() for s in stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STAGES]
    if unknown or not chosen:
        err.print(f"[red]error:[/red] unknown stage(s) {', '.join(unknown) or '(none given)'}; available: {', '.join(STAGES)}", highlight=False)
        raise typer.Exit(2)
    _run_stages(config, chosen)


def _run_stages(config: Path, stages: list[str]) -> None:
    cfg = _config_or_exit(config)  # fail on a bad config before Prefect starts
    from flows.pipeline import pipeline

    try:
        pipeline(str(config), ",".join(stages))
    except Exception as exc:  # the flow run's log has the details
        err.print(f"[red]pipeline failed:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    _print_stats(cfg.run_dir, as_json=False)
    if "eval" in stages:
        from flows.demo import render_eval

        console.print(render_eval(cfg.draft_dir))


@app.command()
def plan(config: Path = typer.Argument(..., help="The YAML run config.")) -> None:
    """What every stage still has to do: tokens, disk bytes against free space, time when known."""
    from flows.plan import print_plan

    raise typer.Exit(0 if print_plan(_config_or_exit(config), console) else 1)


@app.command()
def stats(
    run_dir: Path = typer.Argument(..., help="A run directory (run_dir of a config)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Per-dataset table of a run from Parquet footers only (fast, safe while a run is writing)."""
    if not run_dir.is_dir():
        err.print(f"[red]error:[/red] {escape(str(run_dir))} is not a directory (give the run_dir of a config)", highlight=False)
        raise typer.Exit(2)
    _print_stats(run_dir, as_json=as_json)


def _print_stats(run_dir: Path, *, as_json: bool) -> None:
    import json

    from tasks.records import record_stats
    from tasks.stats import collect_stats, render_rows_table, render_stats_table, stats_rows

    collected = collect_stats(run_dir)
    records = [r.row() for r in record_stats(run_dir)]
    if as_json:
        print(json.dumps({"responses": stats_rows(collected), "records": records}, indent=2))
        return
    console.print(render_stats_table(collected))
    if records:
        console.print(render_rows_table("training records per dataset", records))


@app.command("import-jsonl")
def import_jsonl(
    run_dir: Path = typer.Argument(..., help="The run directory to import into (its config.yaml names the target tokenizer)."),
    dataset: str = typer.Argument(..., help="Dataset name (directory under responses/)."),
    file: Path = typer.Argument(..., help="A legacy raw_responses.jsonl."),
    target: Optional[str] = typer.Option(None, help="Target tokenizer path (default: target.path of RUN_DIR/config.yaml)."),
) -> None:
    """Adopt a legacy raw_responses.jsonl (nested usage.completion_tokens or flat completion_tokens) as checkpoints."""
    from flows.config import ConfigError, load_config
    from tasks.legacy_import import import_jsonl as do_import

    if not file.is_file():
        err.print(f"[red]error:[/red] no such file {escape(str(file))}", highlight=False)
        raise typer.Exit(2)
    trust = False
    if target is None:
        try:
            cfg = load_config(run_dir / "config.yaml")
        except ConfigError as exc:
            err.print(f"[red]error:[/red] cannot tell the target tokenizer: {escape(str(exc))}\nPass --target PATH.", highlight=False)
            raise typer.Exit(2) from None
        target, trust = cfg.target.path, cfg.target.trust_remote_code
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust)
    report = do_import(run_dir, dataset, file, tokenizer=tokenizer)
    console.print(escape(str(report)), highlight=False)


@app.command("tiny-target")
def tiny_target(
    out_dir: Path = typer.Argument(..., help="Directory to write the model and tokenizer to."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    num_layers: int = typer.Option(8, help="Decoder layers (at least 8, so the EAGLE-3 aux layers are distinct)."),
    hidden_size: int = typer.Option(128, help="Hidden size."),
) -> None:
    """Build the deterministic tiny Llama target (random weights, BPE tokenizer, chat template)."""
    from models.tiny_target import build_tiny_target

    try:
        path = build_tiny_target(out_dir, seed=seed, num_layers=num_layers, hidden_size=hidden_size)
    except ValueError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"tiny target written to {path}")


@app.command("serve-dev")
def serve_dev(
    model: Path = typer.Option(..., help="Directory of a small Hugging Face causal LM (e.g. from `eagle3 tiny-target`)."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(30000, help="TCP port."),
    context_length: Optional[int] = typer.Option(None, help="Context length (default: the model's max_position_embeddings)."),
    max_batch_size: int = typer.Option(16, help="Most sequences decoded together."),
) -> None:
    """Serve a small model over SGLang's native HTTP API on CPU (for the demo and tests)."""
    from deploy.dev_server import serve

    if not (model / "config.json").is_file():
        err.print(f"[red]error:[/red] {model} has no config.json; build one with `eagle3 tiny-target {model}`", highlight=False)
        raise typer.Exit(2)
    serve(model, host=host, port=port, context_length=context_length, max_batch_size=max_batch_size)


def _config_or_exit(path: Path):
    """The validated config at `path`; on any problem print them all and exit with status 2."""
    from flows.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        err.print(escape(str(exc)), style="red", highlight=False)
        raise typer.Exit(2) from None


def main() -> None:
    app()


if __name__ == "__main__":
    main()
