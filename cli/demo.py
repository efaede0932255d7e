"""`eagle3 demo`: every stage of the pipeline on the embedded default (tiny target, dev server, sample data)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from rich.console import Console, Group, RenderableType
from rich.table import Table

from cli.demo_targets import DEMO_ENGINES, DEMO_TARGETS, REPO, sglang_python, vllm_python
from flows.config.file import dump_config, load_config
from flows.pipeline import pipeline
from models.target.tiny import build_target
from settings.run import RunConfig
from tasks.eval.benchmarks import benchmark_rows
from tasks.eval.tasks import context_rows, engine_rows
from tasks.generate.provenance import Provenance, check_record, last_run_provenance, target_fingerprint
from tasks.responses.checkpoints import live_parts
from tasks.responses.stats import collect_stats, render_rows_table, render_stats_table
from tasks.runtime.ports import free_port
from tasks.serving import sglang, vllm
from tasks.serving.launch import SERVER_LOG

SHOWN_PER_DATASET = 2
TEXT_COLUMNS = ("benchmark", "format", "anchor_draft")  # the benchmark table's left-aligned columns


def demo_config(
    run_dir: Path | None = None, target: str = "llama", engine: str | None = None, draft_arch: str = "llama"
) -> RunConfig:
    """The demo preset of `target` (configs/demo.yaml, configs/demo-kimi.yaml) with paths resolved against the
    repository root, in `run_dir`, else in the demo's own run directory for `target`, `engine` and `draft_arch`
    (`demo_run_dir`); `draft_arch` mla trains the MLA draft (train.draft_arch)."""
    config = load_config(DEMO_TARGETS[target].config, base=REPO)
    config.run_dir = (
        run_dir.resolve() if run_dir is not None else demo_run_dir(config.run_dir, target, engine, draft_arch)
    )
    if draft_arch != config.train.draft_arch:
        config.train = type(config.train).model_validate({**config.train.model_dump(), "draft_arch": draft_arch})
    return config


def demo_run_dir(preset: Path, target: str, engine: str | None, draft_arch: str = "llama") -> Path:
    """One run directory per target, engine and draft shape, so that a demo never resumes another engine's responses
    (a run directory records what made them and refuses another: tasks/generate/provenance.py) or another shape's
    draft: the preset's run_dir (runs/demo, runs/demo-kimi, runs/demo-kimi-long) through the target's own engine,
    with `-<engine>` added through another (runs/demo-vllm, runs/demo-sglang, runs/demo-kimi-dev), and `-mla` for
    the MLA draft (runs/demo-kimi-mla, runs/demo-kimi-sglang-mla)."""
    name = preset.name if engine is None or engine == DEMO_TARGETS[target].engine else f"{preset.name}-{engine}"
    return preset.with_name(name + ("-mla" if draft_arch == "mla" else ""))


def demo_server(config: RunConfig, engine: str, url: str, max_model_len: int | None = None):
    """The demo's server section at `url`: the dev server (SGLang's emulation), a real SGLang from .venv-sglang, or a
    real vLLM from .venv-vllm (with `max_model_len`, else its CPU command's default), each started by the pipeline."""
    server = {**config.server.model_dump(), "url": url, "launch": "dev"}
    if engine == "vllm":
        command = vllm.cpu_command(
            str(vllm_python()),
            config.target.path,
            mla_draft=config.train.draft_arch == "mla",
            max_model_len=max_model_len or vllm.DEFAULT_MAX_MODEL_LEN,
            trust_remote_code=config.target.trust_remote_code,
        )
        server.update(engine="vllm", launch="command", command=command)
    if engine == "sglang":
        command = sglang.cpu_command(
            str(sglang_python()), config.target.path, trust_remote_code=config.target.trust_remote_code
        )
        server.update(engine="sglang", launch="command", command=command)
    return type(config.server).model_validate(server)


def run_demo(
    run_dir: Path | None = None,
    console: Console | None = None,
    target_dir: Path | None = None,
    capture_backend: str = "deepspeed",
    overrides: dict[str, dict] | None = None,
    engine: str = "dev",
    target: str = "llama",
    draft_arch: str = "llama",
) -> RunConfig:
    """Run the whole pipeline as one Prefect flow run on the sample data (dev server on a free port), print the results.

    `run_dir`: by default one per target and engine (`demo_run_dir`: runs/demo, runs/demo-vllm, runs/demo-kimi, ...);
    a run directory made with another engine or target is refused before anything starts (OtherEngine).

    `engine` "vllm": generate and the engine eval go through a real vLLM (.venv-vllm's CPU build) started by the
    pipeline, instead of the dev server's SGLang emulation. "sglang": the same through a real SGLang 0.5.23
    (.venv-sglang, whose CPU kernel ops are our labelled stand-ins: docs/engines.md), its own EAGLE-3 worker serving
    the draft in the engine eval.
    `capture_backend` "vllm": the capture stage starts a real vLLM (.venv-vllm) with the extraction config and our
    connector (deploy/vllm-plugins) instead of DeepSpeed ranks (`capture_engine`).
    `overrides`: {section: {setting: value}} over configs/demo.yaml, validated like the file (the tests' shorter demo).
    `target` "kimi": the Kimi-K2.5-shaped tiny target's preset, configs/demo-kimi.yaml; "kimi-long": the same target
    trained on a book, writing answers of up to ~2,100 tokens, configs/demo-kimi-long.yaml.
    `draft_arch` "mla": the MLA draft (train.draft_arch: mla) instead of the preset's Llama-style one, in a run
    directory of its own (`demo_run_dir`).
    """
    console = console or Console()
    config = demo_config(run_dir, target, engine, draft_arch)
    for section, values in (overrides or {}).items():
        current = getattr(config, section)
        setattr(config, section, type(current).model_validate({**current.model_dump(), **values}))
    if target_dir is not None:
        config.target.path = str(target_dir)
    # another engine's or target's run directory: refused in seconds, before a target is built or a server started
    check_record(config.layout, demo_provenance(config, engine), fallback=last_run_provenance(config.layout))
    if config.target.build_tiny_target:  # first: vLLM's command follows the target's shape (its config.json)
        build_target(
            config.target.path,
            config.target.tiny_shape,
            quantize=config.target.tiny_quantize,
            **({"base_dir": DEMO_TARGETS[target].base} if DEMO_TARGETS[target].base else {}),
        )
    config.server = demo_server(
        config, engine, f"http://127.0.0.1:{free_port()}", max_model_len=DEMO_TARGETS[target].max_model_len
    )
    if capture_backend == "vllm":
        config.capture = capture_engine(config, DEMO_TARGETS[target].max_model_len)
    layout = config.layout
    config_path = layout.demo_config  # the resolved demo config, as the flow's input
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(dump_config(config))
    console.rule("eagle3 demo: flow `pipeline` (generate -> records -> capture -> train -> eval)")
    server = DEMO_ENGINES[engine]
    console.print(
        f"config: {config_path}; {server} runs at {config.server.url} during generate (log: {layout.logs / SERVER_LOG})"
    )
    results = pipeline(str(config_path))
    console.print(f"{server} stopped")

    console.rule("stage 1: generate")
    console.print(_sample_table(config))
    console.print(render_stats_table(collect_stats(config.run_dir)))
    console.rule("stage 2: records")
    console.print(render_rows_table("data report: training records per dataset", results["records"]))
    console.print(f"token counts for the draft vocabulary: {layout.token_counts}")
    console.rule("stage 3: capture")
    hidden = results["capture"]
    console.print(
        f"hidden states: {hidden['samples']:,} samples, {hidden['tokens']:,} tokens, aux layers {hidden['aux_layers']} "
        f"+ final, {hidden['dtype']}, in {layout.hidden_dir}"
    )
    console.rule("stage 4: train")
    trained = results["train"]
    console.print(
        f"trained {trained['steps']:,} steps on {trained['tokens']:,} tokens; metrics {layout.metrics}, "
        f"plot {trained['plot']}"
    )
    console.rule("stage 5: eval")
    report = results["eval"]
    console.print(render_eval(layout.eval_report))
    if report.get("engine"):
        console.print(render_engine(report["engine"]))
    console.print(f"run directory: {config.run_dir}   (`eagle3 stats {config.run_dir}` prints the tables again)")
    console.print(eval_summary_line(report) + f"; exported draft: {layout.final}")
    return config


def capture_engine(config: RunConfig, max_model_len: int | None):
    """The capture section through a real vLLM the capture stage starts (launch: command, a free port): the CPU build's
    command (tasks/serving/vllm.py capture_cpu_command), with a context one token longer than generate's, since a
    record is a prompt and its whole answer and the extraction asks for one token more."""
    context = (max_model_len or vllm.DEFAULT_MAX_MODEL_LEN) + 1
    command = vllm.capture_cpu_command(
        str(vllm_python()), config.target.path, max_model_len=context, trust_remote_code=config.target.trust_remote_code
    )
    engine = {
        **config.capture.engine.model_dump(),
        "launch": "command",
        "url": f"http://127.0.0.1:{free_port()}",
        "command": command,
    }
    return type(config.capture).model_validate({**config.capture.model_dump(), "backend": "vllm", "engine": engine})


def demo_provenance(config: RunConfig, engine: str) -> Provenance:
    """What this demo will generate with, as `--engine` names it (DEMO_ENGINES' names are the engine kinds of
    tasks/generate/provenance.py); the generate stage asks the server itself."""
    launch = "dev" if engine == "dev" else "command"
    return Provenance(engine, config.target.path, target_fingerprint(config.target.path), launch=launch)


def served_by(engine: dict) -> str:
    """Who served an engine eval report: a real vLLM, the dev server (its /server_info version ends -eagle3-dev,
    emulators/dev_server), or a real SGLang."""
    if engine.get("engine") == "vllm":
        return "a real vLLM"
    version = (engine.get("server") or {}).get("version") or ""
    return "a real SGLang" if version and not version.endswith("-eagle3-dev") else "the dev server"


def eval_summary_line(report: dict) -> str:
    """The demo's last word: the measured acceptance length of each backend that ran, and whether they agree."""
    k = report["num_steps"]
    said = []
    if "trained" in report:
        baseline = f" (untrained: {report['untrained']['acceptance_length']:.3f})" if "untrained" in report else ""
        said.append(f"acceptance length {report['trained']['acceptance_length']:.3f}{baseline} in-process (HF)")
    if report.get("engine"):
        o = report["engine"]["overall"]
        speedup = f", {o['speedup']:.2f}x the tokens/s without the draft" if o.get("speedup") else ""
        where = served_by(report["engine"])
        said.append(
            f"{o['per_round']:.3f} per verify round through {where} with the draft (SGLang's count, with the "
            f"prefill token: {o['acceptance_length']:.3f}{speedup})"
        )
    line = "; ".join(said) + f", {k} draft tokens per round"
    if report.get("engine_vs_hf"):
        c = report["engine_vs_hf"]
        line += (
            f"; engine and HF {'EQUAL' if c['equal'] else 'DIFFER'} on the same {c['prompts_compared']} prompts "
            f"({c['same_verify_rounds']} with the same verify rounds)"
        )
    return line


def render_engine(engine: dict) -> Table:
    """The engine eval per dataset (tasks/eval/tasks.py engine_rows): acceptance, its spread, tokens/s, speedup."""
    rows = engine_rows(engine)
    where = served_by(engine)
    table = Table(
        title=f"engine eval: {where} with the draft, then without; {engine['concurrency']} request(s) at once",
        caption="acceptance length: SGLang's completion tokens / verify rounds; per round: without the prefill token",
    )
    for column in rows[0]:
        table.add_column(column.replace("_", " "), justify="left" if column == "dataset" else "right")
    for row in rows:
        table.add_row(
            *[
                "" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:.3f}" if isinstance(v, float) else str(v)
                for v in row.values()
            ]
        )
    return table


def render_eval(eval_report: Path) -> RenderableType:
    """The eval stage's result (draft/eval.json, RunLayout.eval_report): acceptance length per draft, the TTT
    estimate, where the draft is; by context position (in-process and vLLM's); then the benchmarks beside their
    published anchors, when the eval ran some."""
    report = json.loads(eval_report.read_text())
    parts: list[RenderableType] = [render_eval_table(report)]
    if context_rows(report):
        parts.append(render_context(context_rows(report), report))
    if report.get("benchmarks"):
        parts.append(render_benchmarks(report["benchmarks"], report["num_steps"]))
    return Group(*parts)


def render_context(rows: list[dict], report: dict) -> Table:
    """The acceptance length by context position (tasks/eval/tasks.py context_rows): a row per bucket, a column per
    source."""
    table = Table(
        title="acceptance length by context position (tokens before a round's first draft token)",
        caption=context_caption(list(rows[0]), report),
    )
    for column in rows[0]:
        table.add_column(column, justify="left" if column == "context" else "right")
    for row in rows:
        table.add_row(
            *[
                "" if v is None else f"{v:.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v
                for v in row.values()
            ]
        )
    return table


def context_caption(columns: list[str], report: dict) -> str:
    """What each column of the context table holds, for the columns it has (context_rows names them)."""
    engine = (report.get("engine") or {}).get("engine")
    by_engine = [c for c in columns if engine and c.endswith(f"({engine})")]
    benchmarks = [c for c in columns if c not in ("context", "rounds", "trained", "untrained", *by_engine)]
    said = []
    if "rounds" in columns:
        whose = "in-process" if "trained" in columns else f"as {engine} counted them"
        said.append(f"rounds: the trained draft's verify rounds on the eval prompts ({whose})")
    if benchmarks:
        said.append(f"{', '.join(benchmarks)}: the trained draft on that benchmark")
    if by_engine:
        placed = {report["engine"]["overall"].get("placed_by")} | {
            b.get("engine", {}).get("placed_by") for b in (report.get("benchmarks") or {}).values()
        }
        how = (
            "each verify round where it starts"
            if placed & {"round", "round and request"}
            else "each whole request in the bucket where its rounds start (the engine sends a request's totals only)"
        )
        said.append(f"({engine}): as the serving engine counted them, {how}; the rest in-process")
    else:
        said.append("all in-process")
    return "; ".join(said)


def render_benchmarks(section: dict, num_steps: int) -> Table:
    """eval.json's benchmarks (tasks/eval/benchmarks.py benchmark_rows): ours beside the published anchor."""
    rows = benchmark_rows(section)
    table = Table(
        title=f"published benchmarks: trained draft, {num_steps} steps, top-k 1, {num_steps + 1} draft tokens, greedy "
        "target",
        caption="acceptance length: completion tokens / verify rounds, as SpecForge's bench_eagle3 counts it and the "
        "anchors were published; per round: without the prefill's token; anchor: data/benchmarks/anchors.json for "
        "this target (or the config's). A tiny target is not a published one: docs/acceptance.md",
    )
    for column in rows[0]:
        table.add_column(column.replace("_", " "), justify="left" if column in TEXT_COLUMNS else "right")
    for row in rows:
        table.add_row(*["" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()])
    return table


def render_eval_table(report: dict) -> Table:
    """The eval's acceptance length per draft and backend, and the TTT estimate."""
    k = report["num_steps"]
    table = Table(
        title=f"acceptance length: {k} draft tokens per round (SGLang topk 1), greedy target, "
        f"{report['prompts']} prompts (held-out records, then eval.prompt_files)",
        caption=f"draft: {report['draft']}\nserve: {report['sglang_command']}",
    )
    for column in ("draft", "acceptance length", *[f"pos {i + 1}" for i in range(k)], "rounds"):
        table.add_column(column, justify="left" if column == "draft" else "right")
    rows = [(f"{name}, measured", report[name]) for name in ("untrained", "trained") if name in report]
    if report.get("engine"):  # per verify round, as the HF rows count; per position is not in SGLang's replies
        o = report["engine"]["overall"]
        where = served_by(report["engine"]).removeprefix("a real ").removeprefix("the ")
        rows.append(
            (
                f"trained, measured by the engine ({where} + draft)",
                {"acceptance_length": o["per_round"], "per_position_acceptance": [], "rounds": o["verify_rounds"]},
            )
        )
    if report.get("ttt_estimate"):  # the same num_steps, but teacher-forced on held-out records: not a measurement
        rows.append(("trained, training-time estimate (teacher-forced)", {**report["ttt_estimate"], "rounds": None}))
    for name, r in rows:
        per_position = [f"{a:.3f}" for a in r["per_position_acceptance"]] or [""] * k
        table.add_row(
            name, f"{r['acceptance_length']:.3f}", *per_position, "" if r.get("rounds") is None else f"{r['rounds']:,}"
        )
    return table


def _sample_table(config: RunConfig) -> Table:
    """A few generated responses per dataset, read back from the checkpoints."""
    table = Table(
        title="sample responses (tiny target trained a minute on the samples: it echoes sentences it has learned)",
        show_lines=True,
    )
    for column in ("dataset", "id", "response", "tokens", "finish"):
        table.add_column(column, overflow="fold")
    for dataset in config.datasets:
        parts = live_parts(config.layout.responses(dataset.name))
        if not parts:
            continue
        rows = pq.read_table(
            parts[0], columns=["id", "text", "prompt_tokens", "completion_tokens", "finish_reason"]
        ).to_pylist()
        for row in rows[:SHOWN_PER_DATASET]:
            table.add_row(
                dataset.name,
                row["id"],
                _short(row["text"], 100),
                f"{row['prompt_tokens']}+{row['completion_tokens']}",
                row["finish_reason"],
            )
    return table


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
