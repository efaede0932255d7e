"""The `eval:` section and its `eval.benchmarks[]`: how the exported draft is measured, each key once.

`EvalSettings` is what the eval's job file carries (models/common/job_files.py `EvalJobFile`); `ServedEvalSettings`
is how the engine eval measures (tasks/eval/tasks.py). `EvalConfig`, the section, adds which draft is measured.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from settings.base import Section, StrictModel
from settings.hub_paths import hub_repo_id, is_hub_path
from settings.server import ServerUrl

PROBES = "context_probes"  # the benchmark the context probes are decoded as (models/eval/probes.py)
BENCHMARK_FORMATS = ("mt_bench", "gsm8k", "humaneval", "chat", "ids")
BENCHMARK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class BenchmarkSpec(StrictModel):
    """A published benchmark the eval also decodes, in its published format (models/eval/benchmarks.py), reported on its
    own beside the published acceptance length for the target."""

    name: str
    """Its name in eval.json and the tables, e.g. mt_bench (letters, digits, '_', '.', '-')."""
    path: str
    """The benchmark's rows as published: a local JSONL (.jsonl, .jsonl.gz) or Parquet file (relative paths resolve like
    the datasets'), or `hf:ORG/NAME`, a Hub dataset read from the local Hugging Face cache only, never downloaded (`hf
    download --repo-type dataset ORG/NAME` beforehand), with `split` and `config`."""
    format: Literal["mt_bench", "gsm8k", "humaneval", "chat", "ids"] | None = None
    """mt_bench (FastChat's question.jsonl: question_id, category, turns), gsm8k (openai/gsm8k: question, answer),
    humaneval (openai/openai_humaneval: task_id, prompt, ...), chat (a set of one's own: id, messages, each
    conversation asked as it is, e.g. data/eval/long_context.jsonl) or ids (id, input_ids: token ids sent as they are,
    no chat template). Omitted: told from the first row's keys."""
    limit: int | None = Field(default=80, ge=1)
    """Questions decoded, the first ones in file order (MT-bench has 80); null: all of them."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Tokens generated per question. Omitted: eval.max_new_tokens. SpecForge's benchmarks allow 2048 (MT-bench),
    512 (GSM8K), 1024 (HumanEval)."""
    anchor: float | None = Field(default=None, ge=1)
    """A published acceptance length to print beside ours (completion tokens / verify rounds, as SpecForge's
    bench_eagle3 counts). Omitted: the one data/benchmarks/anchors.json holds for the target (matched on target.path's
    last part) and this format, if any."""
    split: str | None = None
    """`hf:` benchmarks: the split to read. Omitted: test."""
    config: str | None = None
    """`hf:` benchmarks: the dataset's config (subset), e.g. main for openai/gsm8k. Omitted: its default."""

    @field_validator("name")
    @classmethod
    def _name_is_a_word(cls, value: str) -> str:
        if not BENCHMARK_NAME.match(value):
            raise ValueError(f"{value!r}: a benchmark name is letters, digits, '_', '.', '-', from a letter or digit")
        return value

    @model_validator(mode="after")
    def _hub_settings_only_for_hub_paths(self) -> BenchmarkSpec:
        given = [key for key in ("split", "config") if getattr(self, key) is not None]
        if given and not self.path.startswith("hf:"):
            raise ValueError(f"{', '.join(given)}: for hf: benchmarks only; {self.path} is a local file")
        return self


class EvalSettings(StrictModel):
    """`eagle3 eval`: speculative decoding with the HF target (greedy) and the exported draft on held-out prompts."""

    prompts: int = Field(default=32, ge=1)
    """Prompts decoded: held-out records' prompts first, then prompt_files' prompts, up to this many."""
    prompt_files: list[Path] = Field(default_factory=list)
    """JSONL prompt sets for the eval beside the held-out records (e.g. data/eval/prompts.jsonl): rows with `id` and
    `messages` ([{role, content}]) or `prompt` (a string), rendered with the target's chat template and the
    generation prompt. Relative paths are resolved like the datasets' paths."""
    max_new_tokens: int = Field(default=128, ge=1)
    """Tokens generated per prompt."""
    num_steps: int = Field(default=3, ge=1, le=16)
    """Draft tokens per verify round (SGLang --speculative-num-steps; top-k 1, num-draft-tokens = this + 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the target and draft run; auto: cuda if available."""
    compare_untrained: bool = True
    """Also measure the draft as training starts it (same seed, untrained): the baseline the trained one must beat."""
    benchmarks: list[BenchmarkSpec] = Field(default_factory=list)
    """Published benchmarks (MT-bench, GSM8K, HumanEval) decoded with the trained draft after the eval prompts, each
    reported on its own in eval.json and a table, beside the published acceptance length for the target where one is
    known (docs/acceptance.md, Benchmarks and published anchors)."""
    context_buckets: list[int] = Field(default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384, 32768])
    """Edges of the context-position buckets the eval reports acceptance in (models/eval/context.py), in-process and
    in the engine: a verify round falls in [0, e1), [e1, e2), ... or [e_last, inf) by the tokens before its first draft
    token (prompt and answer so far). Ascending positive token counts; [] reports one bucket."""

    context_probes: int = Field(default=0, ge=0)
    """Context probes (models/eval/probes.py): up to this many held-out records cut at each edge of context_buckets,
    inside the target's answer (its own recorded text up to exactly that many tokens), each continued for
    context_probe_tokens and reported as the benchmark `context_probes`. Every engine places a probe's rounds in the
    bucket it starts (SGLang too, which reports a request's totals only). 0: none."""
    context_probe_tokens: int = Field(default=64, ge=2)
    """Tokens each context probe generates. Fewer than the narrowest bucket is wide (512 with the default edges) keeps
    each probe's rounds in one bucket."""

    @field_validator("context_buckets")
    @classmethod
    def _ascending_edges(cls, value: list[int]) -> list[int]:
        if any(e < 1 for e in value) or any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError(
                f"{value}: context_buckets are the buckets' edges in tokens, ascending and positive, e.g. [512, 1024, "
                "2048]"
            )
        return value

    @field_validator("benchmarks")
    @classmethod
    def _unique_benchmark_names(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        names = [b.name for b in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"benchmark name(s) {repeated} given more than once: each name once")
        return value


class ServedEvalSettings(StrictModel):
    """How the eval is measured: in-process with HF transformers, through the serving engine, or both side by side."""

    backend: Literal["hf", "engine", "both"] = "hf"
    """hf: speculative decoding in-process with the HF target (the whole target in this process's GPUs: small targets,
    the demo). engine: the eval starts the server (server.launch dev|command) with the exported draft (SGLang's
    --speculative-* flags from num_steps), decodes the prompts greedily through /generate and reads the acceptance
    from meta_info, then again without the draft for the speedup (a 1T target). both: each, on the same prompts, side
    by side in eval.json."""
    concurrency: int = Field(default=1, ge=1, le=1024)
    """engine: eval requests in flight at once (1: batch-size-1 latency, where speculative decoding gains most)."""
    baseline: bool = True
    """engine: also decode the prompts without the draft, for the speedup in tokens/s."""
    baseline_url: ServerUrl | None = None
    """engine with server.launch: none: a running server of the same target WITHOUT the draft, for the speedup
    (server.url must then serve the draft). Unset: no speedup is measured with launch: none."""


class EvalConfig(EvalSettings, ServedEvalSettings, Section):
    """`eagle3 eval`: greedy speculative decoding with the target and the exported draft on the eval prompts, measured
    in-process (HF), through the serving engine, or both."""

    draft: str = Field(default="final", min_length=1)
    """The draft measured: `final` (the train stage's last export, RUN_DIR/draft/final), `best` (its export at the
    best held-out eval, RUN_DIR/draft/best), or the directory of any EAGLE-3 draft for this target: ours, an
    SGLang-style export (SpecForge's, either dtype key) or the speculators format; its report is then
    RUN_DIR/evals/<directory name>-<8 hex digits of its path>/eval.json. `eagle3 eval CONFIG --draft DIR` sets it
    for one run."""

    @field_validator("benchmarks")
    @classmethod
    def _probes_name_is_the_eval_s(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        if any(b.name == PROBES for b in value):
            raise ValueError(f"{PROBES!r} names the eval's context probes (eval.context_probes): name it otherwise")
        return value

    @field_validator("benchmarks")
    @classmethod
    def _hub_benchmarks_have_their_form(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        for b in value:
            if is_hub_path(b.path):
                try:
                    hub_repo_id(b.path)
                except ValueError:
                    raise ValueError(
                        f"{b.name}: {b.path!r} is not a Hub dataset path: expected hf:ORG/NAME, e.g. hf:openai/gsm8k "
                        "(split and config are the benchmark's settings)"
                    ) from None
        return value
