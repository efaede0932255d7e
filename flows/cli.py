"""`eagle3`: the command line of eagle3-pipeline."""

from __future__ import annotations

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
console = Console()
err = Console(stderr=True)


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
    from flows.config import ConfigError, load_config
    from flows.validate import validate_datasets

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        err.print(escape(str(exc)), style="red", highlight=False)
        raise typer.Exit(2) from None
    ok = validate_datasets(cfg, config_path=config, console=console)
    raise typer.Exit(0 if ok else 1)


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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
