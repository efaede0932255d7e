"""The eval's published benchmarks (`eval.benchmarks`) on the pipeline's side: Hub benchmarks written to local files
before the job starts, the published anchors, eval.json's `benchmarks` section and its table.

The eval job (models/eval/job.py) reads only local files: a `hf:ORG/NAME` benchmark is read here from the local
Hugging Face cache (tasks/datasets/hub.py, cache only: never a download) and written, one row a line, to
RUN_DIR/jobs/benchmarks/<name>.jsonl beside the job that names it, and so are the context probes cut from the
held-out records (`eval.context_probes`, models/eval/probes.py: the `ids` benchmark context_probes). Every benchmark is
read here once (its format told, every row checked), so a bad row stops the stage before the target is loaded.

Anchors: data/benchmarks/anchors.json, per target (matched on the last part of target.path) and benchmark format, the
acceptance lengths published for EAGLE-3 drafts at 3 steps, top-k 1, 4 draft tokens, counted as SpecForge's
bench_eagle3 counts them: completion tokens / verify rounds. An entry's own `anchor` wins.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from prefect import get_run_logger

from models.common.atomic import write_atomic
from models.common.job_files import EvalJobFile
from models.eval.benchmarks import read_benchmark
from models.eval.probes import probe_rows
from settings.eval import PROBES, BenchmarkSpec
from settings.hub_paths import hub_repo_id, is_hub_path
from tasks.datasets.hub import HubDataset, read_hub

ANCHORS = Path(__file__).resolve().parents[2] / "data/benchmarks/anchors.json"  # in the repository


def resolve_benchmarks(benchmarks: list[BenchmarkSpec], rows_dir: Path) -> list[BenchmarkSpec]:
    """The benchmarks as the eval job reads them: each read and checked, its format set, a Hub one's rows written to
    rows_dir/<name>.jsonl (from the local cache only)."""
    out = []
    for spec in benchmarks:
        if is_hub_path(spec.path):
            split = spec.split or "test"
            source = f"{spec.path} ({', '.join(x for x in (spec.config, split) if x)})"
            local = spec.model_copy(
                update={"path": str(hub_rows(spec, split, rows_dir)), "split": None, "config": None}
            )
            fmt = read_benchmark(local, source=source).format
        else:
            local = spec
            fmt = read_benchmark(spec).format
        out.append(local.model_copy(update={"format": fmt}))
    return out


def probe_benchmark(
    datasets: list, eval_fraction: float, edges: list[int], per_edge: int, new_tokens: int, rows_dir: Path
) -> list[BenchmarkSpec]:
    """`eval.context_probes` (models/eval/probes.py): the held-out records cut at each edge, written to
    rows_dir/context_probes.jsonl, as the `ids` benchmark that decodes them; [] (said in the log) when no held-out
    record's answer reaches an edge."""
    from models.train.data import held_out_records  # torch: only where probes are asked for

    rows = probe_rows(held_out_records(datasets, eval_fraction), edges, per_edge)
    logger = get_run_logger()
    if not rows:
        logger.warning(
            "eval.context_probes: no held-out record's answer reaches a context bucket edge (%s): no probes", edges
        )
        return []
    out = rows_dir / f"{PROBES}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))
    at = Counter(len(r["input_ids"]) for r in rows)
    logger.info(
        "context probes: %d held-out records cut inside an answer (%s), each continued for %d tokens (%s)",
        len(rows),
        ", ".join(f"{n} at {edge} tokens" for edge, n in sorted(at.items())),
        new_tokens,
        out,
    )
    return [BenchmarkSpec(name=PROBES, path=str(out), format="ids", limit=None, max_new_tokens=new_tokens)]


def hub_rows(spec: BenchmarkSpec, split: str, rows_dir: Path) -> Path:
    """A Hub benchmark's split from the local Hugging Face cache, one JSON row a line in rows_dir/<name>.jsonl."""
    source = HubDataset(hub_repo_id(spec.path), split=split, config=spec.config, cache_only=True)
    rows = read_hub(source, lambda path, schema: list(schema.names))
    text = "".join(json.dumps(raw.data, ensure_ascii=False, default=str) + "\n" for raw in rows)
    out = rows_dir / f"{spec.name}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, text)


def published_anchors(target_path: str, fmt: str, anchors: Path = ANCHORS) -> list[dict[str, Any]]:
    """Every published figure for the target (matched on target_path's last part) on the benchmark format `fmt`,
    the table's first; [] when none is known."""
    name = Path(target_path.rstrip("/")).name.lower()
    data = json.loads(anchors.read_text(encoding="utf-8"))
    found = []
    for target, entry in data["targets"].items():
        if name in {n.lower() for n in [target, *entry.get("names", [])]}:
            for draft in entry["drafts"]:
                if fmt in draft:
                    found.append(
                        {
                            "acceptance_length": draft[fmt],
                            "target": target,
                            "draft": draft["draft"],
                            "source": draft["source"],
                            "settings": draft["settings"],
                        }
                    )
    return found


def benchmark_section(
    job: EvalJobFile, hf: dict[str, Any] | None, engine: dict[str, Any] | None, anchors: Path = ANCHORS
) -> dict[str, Any]:
    """eval.json's `benchmarks`: per benchmark its format, file, questions, each backend's figures, and the anchor.

    "acceptance_length" is completion tokens / verify rounds as SpecForge's bench_eagle3 counts it (what the anchors
    count): the HF backend's, else the engine's. "per_round" is without the prefill's token (the eval's own count).
    """
    section: dict[str, Any] = {}
    for spec in job.benchmarks:
        h = (hf or {}).get("benchmarks", {}).get(spec.name)
        e = (engine or {}).get("benchmarks", {}).get(spec.name)
        entry: dict[str, Any] = {
            "format": spec.format,
            "path": spec.path,
            "num_steps": job.num_steps,
            "max_new_tokens": spec.max_new_tokens or job.max_new_tokens,
            "prompts": h["prompts"] if h else e["prompts"] if e else 0,
            "acceptance_length": h["acceptance_length_specforge"] if h else e["acceptance_length"] if e else None,
            "per_round": h["acceptance_length"] if h else e["per_round"] if e else None,
        }
        if h:
            entry["hf"] = {k: v for k, v in h.items() if k != "max_new_tokens"}
        if e:
            entry["engine"] = e
        published = published_anchors(job.target.path, spec.format or "", anchors)
        if spec.anchor is not None:
            entry["anchor"] = {
                "acceptance_length": spec.anchor,
                "source": f"eval.benchmarks ({spec.name}).anchor in the config",
            }
        else:
            entry["anchor"] = published[0] if published else None
        entry["published"] = published
        section[spec.name] = entry
    return section


def benchmark_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-benchmarks table: one row per benchmark, ours beside the anchor."""
    rows = []
    for name, b in section.items():
        anchor = b["anchor"] or {}
        ours, theirs = b["acceptance_length"], anchor.get("acceptance_length")
        rows.append(
            {
                "benchmark": name,
                "format": b["format"],
                "questions": b["prompts"],
                "acceptance_length": ours,
                "per_round": b["per_round"],
                "engine": b["engine"]["acceptance_length"] if "engine" in b and "hf" in b else None,
                "anchor": theirs,
                "of_anchor": round(ours / theirs, 3) if ours is not None and theirs else None,
                "anchor_draft": anchor.get("draft") or anchor.get("source") or "none published for this target",
            }
        )
    return rows


def benchmark_table_text(rows: list[dict[str, Any]]) -> str:
    """The benchmark table as aligned text, for the flow's log."""
    columns = list(rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c.replace("_", " ")), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.replace("_", " ").ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
