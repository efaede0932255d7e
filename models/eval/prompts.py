"""The eval's prompts: one selection that every eval backend (HF in-process, serving engine) decodes.

`eval_prompts(job, vocab_size)` returns them in a fixed order, so two backends, two runs and the
untrained baseline all measure on the same token ids: the held-out records' prompts first, then the
prompt sets of `job.prompt_files` in file and line order, up to `job.prompts` in all.
`benchmark_prompts(job, vocab_size)`: each of `job.benchmarks`' questions (models/eval/benchmarks.py), apart.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from models.common.job_files import EvalJobFile
from models.eval.benchmarks import check_messages, read_benchmark
from models.train.data import held_out_prompts


class EvalPrompt(NamedTuple):
    source: str  # the dataset (held-out records) or the prompt file (its stem) it came from
    id: str
    input_ids: list[int]


def eval_prompts(job: EvalJobFile, vocab_size: int | None = None) -> list[EvalPrompt]:
    """Up to `job.prompts` prompts: held-out records' tokens before their first loss token (held-out hash order),
    then the prompt files'.
    """
    out = [EvalPrompt(*p) for p in held_out_prompts(job.datasets, job.eval_fraction, job.prompts, vocab_size)]
    # every file is read (a bad row fails the eval even where the held-out records fill it), rendered as needed
    rows = [
        (Path(path).stem, where, pid, messages)
        for path in job.prompt_files
        for where, pid, messages in read_prompt_file(Path(path))
    ]
    if len(out) < job.prompts and rows:
        tokenizer = _tokenizer(job)
        for source, where, pid, messages in rows[: job.prompts - len(out)]:
            ids = _render(tokenizer, messages)
            if vocab_size is not None and any(i >= vocab_size for i in ids):
                raise ValueError(
                    f"{where}: prompt {pid!r} renders to token ids outside the model's vocabulary ({vocab_size})"
                )
            out.append(EvalPrompt(source, pid, ids))
    return out


def benchmark_prompts(job: EvalJobFile, vocab_size: int | None = None) -> dict[str, list[EvalPrompt]]:
    """Each benchmark's prompts (source: its name), in file order, rendered like the prompt files' prompts; every
    benchmark is read (and checked) before the tokenizer is loaded."""
    read = {spec.name: read_benchmark(spec) for spec in job.benchmarks}
    if not read:
        return {}
    tokenizer = _tokenizer(job)
    out: dict[str, list[EvalPrompt]] = {}
    for name, benchmark in read.items():
        out[name] = []
        for p in benchmark.prompts:
            ids = p.input_ids if p.input_ids is not None else _render(tokenizer, p.messages)
            if vocab_size is not None and any(i >= vocab_size for i in ids):
                raise ValueError(
                    f"{p.where}: question {p.id!r} renders to token ids outside the model's vocabulary ({vocab_size})"
                )
            out[name].append(EvalPrompt(name, p.id, ids))
    return out


def read_prompt_file(path: Path) -> list[tuple[str, str, list[dict[str, str]]]]:
    """("FILE:LINE", id, messages) of each row of a JSONL prompt set; ValueError naming the file and line of a bad row.

    A row is an object with `messages` ([{role, content}], the last one not from the assistant) or
    `prompt` (a string), and an optional `id` (default: a hash of the content, as for datasets).
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read the eval prompt file: {e}") from e
    rows: list[tuple[str, str, list[dict[str, str]]]] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e.msg}") from None
        messages = _messages(row, where)
        pid = row.get("id")
        if pid is None:
            content = {"messages": messages} if "messages" in row else {"prompt": row["prompt"]}
            pid = hashlib.sha256(
                json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
                    "utf-8", "surrogatepass"
                )
            ).hexdigest()[:16]
        elif not isinstance(pid, (str, int)) or isinstance(pid, bool):
            raise ValueError(f"{where}: `id` must be a string or an integer, got {type(pid).__name__}")
        pid = str(pid)
        if pid in seen:
            raise ValueError(f"{where}: id {pid!r} repeats the row at line {seen[pid]}")
        seen[pid] = lineno
        rows.append((where, pid, messages))
    return rows


def _messages(row: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object with `messages` or `prompt`")
    if "messages" in row:
        messages = row["messages"]
        check_messages(messages, where)
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    raise ValueError(f"{where}: a row needs `messages` ([{{role, content}}]) or `prompt` (a string)")


def _tokenizer(job: EvalJobFile) -> Any:
    from models.target.tokenizer import load_tokenizer

    return load_tokenizer(job.target.path, job.target.trust_remote_code)


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]
