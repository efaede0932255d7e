"""Adopt a legacy `raw_responses.jsonl` (one response of the old inference loop per line) as checkpoints.

The old loop wrote two formats over its life; every line may be either, and both become rows of
`tasks.checkpoints.RESPONSE_SCHEMA` in RUN_DIR/responses/<dataset>/, written with `write_part`.

Field mapping (first match wins; `usage.x` means the key x inside the object `usage`;
`choice` is `choices[0]`; `meta_info` is SGLang's object when a /generate body was saved whole; a
`response` that is an object (a whole OpenAI response saved under that key) is searched like the
top level for `usage`, `choices` and `finish_reason`):

  id                 `prompt_id`, then `id` -- except an OpenAI completion id (the line has
                     `object: "chat.completion..."`, or the id starts with "chatcmpl-"), which
                     names the answer, not the prompt. Without one: `stable_id` of the prompt
                     messages exactly as tasks.datasets computes it for a prompt row, so the
                     same prompt in the dataset file counts as done on resume.
  prompt messages    `messages` (a trailing assistant turn is the response, not the prompt),
                     else `prompt` (a string, one user turn). Normalised by tasks.datasets.
  prompt_ids         `prompt_ids`, `input_ids`; else chat_prompt_ids(tokenizer, messages).
  output_ids         `output_ids`; else the output text (below) tokenised.
  output text        `text` (the SGLang era's raw output, reasoning tags included); else
                     reasoning + content, joined as "<think>{reasoning}</think>{content}" (as is
                     when content already starts with <think>), from
                     content:   choice.message.content, choice.text, `response` (string),
                                `content`, `completion`, `output` (string), the trailing
                                assistant turn's content;
                     reasoning: choice.message.reasoning_content, `reasoning_content`,
                                `reasoning`, the trailing assistant turn's reasoning_content.
  prompt_tokens      `prompt_tokens`, usage.prompt_tokens, meta_info.prompt_tokens, len(prompt_ids)
  completion_tokens  `completion_tokens`, usage.completion_tokens, meta_info.completion_tokens,
                     len(output_ids). The server's own count is kept over len(output_ids): it is
                     what the budget spent.
  finish_reason      `finish_reason`, choice.finish_reason, meta_info.finish_reason; a
                     {"type": ...} object gives its type; missing or null -> "unknown".
                     "abort" lines are not responses (the old server dropped them): counted as
                     `aborted` and not imported, so resume generates them.
  reasoning_tokens   `reasoning_tokens`, usage.completion_tokens_details.reasoning_tokens,
                     usage.reasoning_tokens, meta_info.reasoning_tokens; else null.
  cached_tokens      `cached_tokens`, usage.prompt_tokens_details.cached_tokens,
                     meta_info.cached_tokens; else null.
  latency            `latency`, `e2e_latency`, meta_info.e2e_latency; else null.
  finished_at        `finished_at`, `created` (OpenAI: unix time of the completion); else the
                     file's modification time (an upper bound: the line was written by then).

Re-tokenised text may differ from what the target generated: the chat template may render the
prompt differently from the server that answered, reasoning may have been split off or rewritten,
and BPE can segment the same text differently from the sampled ids. A row whose prompt_ids or
output_ids had to be re-tokenised is counted in `ImportReport.retokenized`. A re-tokenised output
whose finish_reason is "stop" gets the tokenizer's eos appended (when the text does not already
end with it): the target emitted it, the old OpenAI-style answer just did not show it, and
training must see the model stop.

Lines: blank lines are ignored. A last line that is not valid JSON (the old loop was killed
mid-write: no trailing newline and/or truncated JSON) is skipped with a warning and reported as
`partial_last_line`; a complete last line without a trailing newline is imported. Any other bad
line raises DatasetError naming the file and line, and nothing of the file is imported; or, with
on_bad_line="skip", it is counted and written to RUN_DIR/rejects/<dataset>/ with stage "import".
The bad lines an import finds in a file replace those earlier imports of that file recorded, so a
line fixed since is no longer listed (and was imported, once).

All or nothing per file, in two phases. Phase 1 reads the whole file once, validates and maps
every line and writes the rows as staged parts: hidden temporary files in the dataset directory
(`.import-*.tmp`, never listed as parts). Phase 2 renames the staged parts into place as the next
part numbers. So a bad line (under "fail"), a write failure or a kill during phase 1 leaves the
dataset's responses as they were (what a kill leaves staged, the next writer's
`clean_stale_temps` removes), and a kill during phase 2 leaves whole parts, which a rerun
completes exactly once because ids already present are skipped. Staging rather than holding the
rows keeps memory bounded for big files (10k lines of 16k-token outputs are ~160M token ids):
only one part's rows are in memory, a part being cut at `flush_every` rows or `flush_tokens`
prompt + output ids, whichever comes first. Renames need no extra disk space.

Failures: a write that the storage refuses (disk full, read-only, quota) raises
models.file_errors.WriteFailed naming the path, what was kept and how to resume. A part already
in RUN_DIR/responses/<dataset>/ that cannot be read raises tasks.parquet_io.DamagedPart naming it
and where to move it; nothing is imported until it is moved. The import holds the run
directory's write lock (tasks.run_lock) for its whole run: a second writer gets RunDirLocked.

Exactly once: ids already in RUN_DIR/responses/<dataset>/ are skipped, a repeated id inside the
file keeps its first line, so importing the same file again adds nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from models.atomic import TMP_SUFFIX, fsync_dir
from models.file_errors import WriteFailed
from models.run_layout import RunLayout
from tasks import datasets
from tasks.checkpoints import PartSummary, done_ids, finish_compaction, live_parts, responses_table
from tasks.datasets import DatasetError, Reject
from tasks.datasets.rows import type_name
from tasks.parquet_io import (
    DamagedPart, clean_stale_temps, next_part_path, read_metadata, reading, write_parquet_atomic,
)
from tasks.generate.prompts import chat_prompt_ids
from tasks.rejects import write_rejects
from tasks.run_lock import run_lock

log = logging.getLogger("eagle3.legacy_import")

OnBadLine = Literal["fail", "skip"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INT32_MAX = 2**31 - 1
# A staged part's rows are Python lists until written (~36 bytes an id): 2M ids is ~70 MB.
FLUSH_TOKENS = 2_000_000
EXPECTED = (
    "expected one JSON object per line: a response of the old loop, flat (output_ids, completion_tokens,"
    " prompt_tokens, finish_reason, text) or nested (usage.completion_tokens, messages, the answer in"
    " response/content/choices[0].message.content)"
)
RESUME = "fix that (free space, permissions) and run the same import again: ids already imported are skipped"


@dataclass
class ImportReport:
    """What one import did. lines == imported + skipped_existing + duplicates + aborted + bad_lines
    + partial_last_line."""

    file: Path
    dataset: str
    lines: int = 0  # non-blank lines read, a partial last line included
    imported: int = 0
    skipped_existing: int = 0  # already in RUN_DIR/responses/<dataset>/
    duplicates: int = 0  # an earlier line of the file had the same id
    partial_last_line: bool = False
    retokenized: int = 0  # imported rows whose prompt_ids or output_ids were re-tokenised
    completion_tokens: int = 0  # of the imported rows
    aborted: int = 0  # finish_reason "abort": not a response, left for generation
    bad_lines: int = 0  # rejected under on_bad_line="skip"
    parts: list[Path] = field(default_factory=list)
    rejects_part: Path | None = None

    def summary(self) -> str:
        """One line for the user: what was read, imported, skipped and where it went."""
        text = (
            f"{self.file}: {self.lines} line(s); {self.imported} imported into {len(self.parts)} part(s),"
            f" {self.skipped_existing} already there, {self.duplicates} duplicate id(s), {self.aborted} aborted"
        )
        if self.partial_last_line:
            text += ", a partial last line skipped"
        if self.bad_lines:
            text += f", {self.bad_lines} bad line(s) skipped (listed in {self.rejects_part})"
        if self.retokenized:
            text += f"; {self.retokenized} re-tokenised (no token ids in the file)"
        return text


def import_jsonl(
    run_dir: Path,
    dataset: str,
    file: Path,
    *,
    tokenizer: Any,
    flush_every: int = 10_000,
    flush_tokens: int = FLUSH_TOKENS,
    on_bad_line: OnBadLine = "fail",
) -> ImportReport:
    """Import the responses in legacy JSONL `file` into RUN_DIR/responses/<dataset>/, each id once.

    `tokenizer` (the target's) is needed only for lines without token ids; None is accepted when
    every line has them. A part holds at most `flush_every` rows and about `flush_tokens` ids.
    Holds RUN_DIR's write lock throughout (RunDirLocked if another process has it).
    """
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f"on_bad_line must be 'fail' or 'skip', got {on_bad_line!r}")
    if flush_every < 1 or flush_tokens < 1:
        raise ValueError(f"flush_every and flush_tokens must be at least 1, got {flush_every}, {flush_tokens}")
    if not dataset or dataset.startswith(".") or Path(dataset).name != dataset:
        raise ValueError(f"dataset {dataset!r} cannot be a directory name under responses/")
    run_dir, file = Path(run_dir), Path(file)
    if not file.is_file():
        raise DatasetError(file, None, "does not exist or is not a file", expected=EXPECTED)
    if run_dir.exists() and not run_dir.is_dir():
        raise DatasetError(run_dir, None, "is not a directory: give the run directory to import into")
    with ExitStack() as stack:
        try:
            stack.enter_context(run_lock(run_dir, f"import-jsonl {dataset}"))
        except OSError as e:  # cannot even create RUN_DIR/.lock: read-only, permissions, full
            raise WriteFailed(RunLayout(run_dir).lock, e, kept="nothing was imported", resume=RESUME) from None
        return _import(RunLayout(run_dir), dataset, file, tokenizer, flush_every, flush_tokens, on_bad_line)


def _import(layout, dataset, file, tokenizer, flush_every, flush_tokens, on_bad_line) -> ImportReport:
    """The import itself, under the lock: stage the whole file, then commit, then record the rejects."""
    directory = layout.responses(dataset)
    existing = _existing_ids(directory, layout, file)
    report = ImportReport(file=file, dataset=dataset)
    staged: list[Path] = []
    try:
        rejects = _stage(file, directory, existing, tokenizer, flush_every, flush_tokens, on_bad_line, report, staged)
    except BaseException:
        _remove(staged)  # nothing of this file goes in: a bad line, a failed write, an interrupt
        raise
    report.parts = _commit(directory, staged, file)
    report.rejects_part = _record_rejects(rejects, layout.rejects(dataset), file, report)

    if report.duplicates:
        log.warning("%s: %d line(s) repeat an earlier line's id; the first is kept", file, report.duplicates)
    if report.retokenized:
        log.warning(
            "%s: %d imported row(s) had no token ids and were re-tokenised; those ids may differ from"
            " what the target generated", file, report.retokenized,
        )
    log.info(
        "%s -> %s: %d line(s), %d imported, %d already there, %d duplicate(s), %d aborted, %d bad",
        file, directory, report.lines, report.imported, report.skipped_existing, report.duplicates,
        report.aborted, report.bad_lines,
    )
    return report


def _record_rejects(rejects: list[Reject], directory: Path, file: Path, report: ImportReport) -> Path | None:
    """This import's bad lines of `file` replace the ones earlier imports of `file` recorded; the part.

    So a line fixed since is no longer listed, and importing the same file again writes nothing new.
    """
    try:
        earlier = [p for p in live_parts(directory) if read_metadata(p).get("stage") == "import" and _only_from(p, file)]
        return write_rejects(rejects, directory, "import", replaces=earlier)
    except DamagedPart as damaged:
        where = RunLayout.of_dataset_dir(directory).quarantine(directory)
        raise damaged.with_advice(
            f"The {report.imported} response(s) are imported; the bad lines are not listed yet. Move it aside:"
            f" mkdir -p {where} && mv {damaged.path} {where}/ -- then run the import again"
        ) from None
    except OSError as e:
        raise WriteFailed(
            directory, e,
            kept=f"all {report.imported} imported response(s) from {file}; its bad lines are not listed in {directory} yet",
            resume=RESUME + " (that lists the bad lines)",
        ) from None


def _only_from(part: Path, file: Path) -> bool:
    with reading(part):
        sources = set(pq.read_table(part, columns=["source"]).column("source").to_pylist())
    return all(Path(s).resolve() == file.resolve() for s in sources)


def _existing_ids(directory: Path, layout: RunLayout, file: Path) -> set[str]:
    """Ids already imported or generated; DamagedPart, with what to do, when a part cannot be read."""
    clean_stale_temps(directory)  # staged parts of an import that was killed: never committed
    try:
        finish_compaction(directory)
        return done_ids(directory)
    except DamagedPart as damaged:
        where = layout.quarantine(directory)
        raise damaged.with_advice(
            f"Nothing was imported. Move it aside: mkdir -p {where} && mv {damaged.path} {where}/ -- then run the"
            f" import again: the responses it held count as not done, so those in {file.name} are imported again,"
            " exactly once"
        ) from None


def _stage(file, directory, existing, tokenizer, flush_every, flush_tokens, on_bad_line, report, staged) -> list[Reject]:
    """Phase 1: read, validate and map every line, writing the rows as staged parts; the rejects."""
    fallback_time = file.stat().st_mtime
    seen: set[str] = set()
    buffer: list[dict[str, Any]] = []
    buffered_tokens = 0
    rejects: list[Reject] = []

    def flush() -> None:
        nonlocal buffered_tokens
        if buffer:
            staged.append(_write_staged(directory, responses_table(buffer), file))
            buffer.clear()
            buffered_tokens = 0

    for lineno, raw, is_last in _lines(file):
        report.lines += 1
        try:
            data = _parse(raw, lineno)
        except _BadLine as bad:
            if is_last and bad.unreadable:
                report.partial_last_line = True
                log.warning(
                    "%s line %d: skipped a partial last line (%s); the old loop was probably killed"
                    " while writing it, so its prompt is not done", file, lineno, bad.reason,
                )
                continue
            _bad_line(file, lineno, raw, None, bad, on_bad_line, report, rejects)
            continue
        try:
            legacy = _Legacy.of(data, fallback_time)
            if legacy.finish_reason == "abort":
                report.aborted += 1
                continue
            if legacy.id in seen:
                report.duplicates += 1
                continue
            seen.add(legacy.id)
            if legacy.id in existing:
                report.skipped_existing += 1
                continue
            row, retokenized = legacy.response_row(tokenizer, lineno)
        except _BadLine as bad:
            _bad_line(file, lineno, raw, _legacy_id_or_none(data), bad, on_bad_line, report, rejects)
            continue
        buffer.append(row)
        buffered_tokens += len(row["prompt_ids"]) + len(row["output_ids"])
        report.imported += 1
        report.retokenized += retokenized
        report.completion_tokens += row["completion_tokens"]
        if len(buffer) >= flush_every or buffered_tokens >= flush_tokens:
            flush()
    flush()
    return rejects


def _write_staged(directory: Path, table: pa.Table, file: Path) -> Path:
    # A hidden .tmp name: not a part for any reader, and removed by the next writer if we die.
    path = directory / f".import-{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    try:
        return write_parquet_atomic(table, path, PartSummary.of_table(table).to_metadata())
    except OSError as e:
        raise WriteFailed(
            directory, e, kept=f"nothing of {file} was imported; {directory} is as it was", resume=RESUME
        ) from None


def _commit(directory: Path, staged: list[Path], file: Path) -> list[Path]:
    """Phase 2: rename the staged parts into place as the next part numbers; the parts."""
    parts: list[Path] = []
    for i, path in enumerate(staged):
        final = next_part_path(directory)
        try:
            os.replace(path, final)
        except BaseException as e:
            _remove(staged[i:])
            if not isinstance(e, OSError):
                raise
            raise WriteFailed(
                final, e,
                kept=f"{len(parts)} of the {len(staged)} part(s) of {file} are in place, whole; the rest is not",
                resume=RESUME,
            ) from None
        parts.append(final)
    fsync_dir(directory)
    return parts


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # best effort: clean_stale_temps removes it on the next run
            pass


# ---------------------------------------------------------------------------------------------


class _BadLine(Exception):
    def __init__(self, reason: str, *, unreadable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreadable = unreadable  # not UTF-8 / not JSON: what a write cut short leaves


def _bad_line(file, lineno, raw, row_id, bad, on_bad_line, report, rejects) -> None:
    if on_bad_line == "fail":
        raise DatasetError(file, lineno, bad.reason, expected=EXPECTED, unit="line") from None
    report.bad_lines += 1
    rejects.append(Reject(file, lineno, row_id, bad.reason, raw.decode("utf-8", "replace").rstrip("\r\n")))
    log.warning("%s line %d: skipped (on_bad_line=skip): %s", file, lineno, bad.reason)


def _lines(file: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(1-based line number, bytes, is the last non-blank line) for every non-blank line."""
    with open(file, "rb") as f:
        pending: tuple[int, bytes] | None = None
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if pending is not None:
                yield pending[0], pending[1], False
            pending = (lineno, raw)
        if pending is not None:
            yield pending[0], pending[1], True


def _parse(raw: bytes, lineno: int) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(
            f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)", unreadable=True
        ) from None
    if lineno == 1:
        text = text.removeprefix("\ufeff")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg}; column {e.colno})", unreadable=True) from None
    if not isinstance(data, dict):
        raise _BadLine(f"a line must be a JSON object, got {type_name(data)}")
    return data


@dataclass
class _Legacy:
    """One line's fields, mapped but not yet tokenised."""

    id: str
    messages: list[dict] | None
    prompt_ids: list[int] | None
    output_ids: list[int] | None
    text: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    finish_reason: str
    reasoning_tokens: int | None
    cached_tokens: int | None
    latency: float | None
    finished_at: float

    @classmethod
    def of(cls, d: dict, fallback_time: float) -> _Legacy:
        inner = d.get("response") if isinstance(d.get("response"), dict) else {}
        usage = _obj(_first(d.get("usage"), inner.get("usage")), "usage")
        meta = _obj(d.get("meta_info"), "meta_info")
        choices = _first(d.get("choices"), inner.get("choices"))
        choice = _obj(choices[0] if isinstance(choices, list) and choices else None, "choices[0]")
        message = _obj(choice.get("message"), "choices[0].message")

        prompt_messages, answer = _split_messages(d)
        messages, prompt_id = _prompt(d, prompt_messages)
        row_id = _legacy_id(d)
        if row_id is None:
            if prompt_id is None:
                raise _BadLine("has no 'id' and no prompt 'messages'/'prompt' to derive one from")
            row_id = prompt_id

        text = _str(d.get("text"), "text")
        if text is None:
            content = _first(
                _str(message.get("content"), "choices[0].message.content"),
                _str(choice.get("text"), "choices[0].text"),
                d.get("response") if isinstance(d.get("response"), str) else None,
                _str(d.get("content"), "content"),
                _str(d.get("completion"), "completion"),
                d.get("output") if isinstance(d.get("output"), str) else None,
                _str(answer.get("content"), "the assistant turn's content"),
            )
            reasoning = _first(
                _str(message.get("reasoning_content"), "choices[0].message.reasoning_content"),
                _str(d.get("reasoning_content"), "reasoning_content"),
                _str(d.get("reasoning"), "reasoning"),
                _str(answer.get("reasoning_content"), "the assistant turn's reasoning_content"),
            )
            if content is not None or reasoning is not None:
                text = _join_reasoning(reasoning, content or "")

        output_ids = _ids(d.get("output_ids"), "output_ids")
        prompt_ids = _first(_ids(d.get("prompt_ids"), "prompt_ids"), _ids(d.get("input_ids"), "input_ids"))
        if output_ids is None and text is None:
            raise _BadLine(
                "has no 'output_ids' and no response text ('text', 'response', 'content',"
                " 'choices[0].message.content', or a trailing assistant turn)"
            )
        if prompt_ids is None and messages is None:
            raise _BadLine("has no 'prompt_ids'/'input_ids' and no prompt 'messages'/'prompt' to tokenise")

        finish = _first(d.get("finish_reason"), choice.get("finish_reason"), inner.get("finish_reason"),
                        meta.get("finish_reason"))
        if isinstance(finish, dict):
            finish = finish.get("type")
        if finish is not None and not isinstance(finish, str):
            raise _BadLine(f"'finish_reason' must be a string or {{type}}, got {type_name(finish)}")

        return cls(
            id=row_id,
            messages=messages,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            text=text,
            prompt_tokens=_count(d, usage, meta, "prompt_tokens"),
            completion_tokens=_count(d, usage, meta, "completion_tokens"),
            finish_reason=finish or "unknown",
            reasoning_tokens=_first(
                _int(d.get("reasoning_tokens"), "reasoning_tokens"),
                _int(_obj(usage.get("completion_tokens_details"), "usage.completion_tokens_details").get(
                    "reasoning_tokens"), "usage.completion_tokens_details.reasoning_tokens"),
                _int(usage.get("reasoning_tokens"), "usage.reasoning_tokens"),
                _int(meta.get("reasoning_tokens"), "meta_info.reasoning_tokens"),
            ),
            cached_tokens=_first(
                _int(d.get("cached_tokens"), "cached_tokens"),
                _int(_obj(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details").get(
                    "cached_tokens"), "usage.prompt_tokens_details.cached_tokens"),
                _int(meta.get("cached_tokens"), "meta_info.cached_tokens"),
            ),
            latency=_first(
                _float(d.get("latency"), "latency"),
                _float(d.get("e2e_latency"), "e2e_latency"),
                _float(meta.get("e2e_latency"), "meta_info.e2e_latency"),
            ),
            finished_at=_first(
                _float(d.get("finished_at"), "finished_at"),
                _float(_first(d.get("created"), inner.get("created")), "created"),
                fallback_time,
            ),
        )

    def response_row(self, tokenizer: Any, lineno: int) -> tuple[dict[str, Any], bool]:
        """The RESPONSE_SCHEMA row, tokenising what is missing; and whether anything was."""
        prompt_ids, output_ids = self.prompt_ids, self.output_ids
        retokenized = prompt_ids is None or output_ids is None
        if retokenized and tokenizer is None:
            raise ValueError(
                f"line {lineno} has no {'prompt_ids' if prompt_ids is None else 'output_ids'}: pass the"
                " target's tokenizer to import_jsonl to tokenise it"
            )
        if prompt_ids is None:
            try:
                prompt_ids = chat_prompt_ids(tokenizer, self.messages)
            except Exception as e:  # a template that rejects these messages: this line's fault
                raise _BadLine(f"cannot render the prompt messages with the chat template ({e})") from None
        if output_ids is None:
            output_ids = [int(i) for i in tokenizer.encode(self.text, add_special_tokens=False)]
            eos = tokenizer.eos_token_id
            if self.finish_reason == "stop" and isinstance(eos, int) and (not output_ids or output_ids[-1] != eos):
                output_ids.append(eos)
        row = {
            "id": self.id,
            "prompt_ids": prompt_ids,
            "output_ids": output_ids,
            "prompt_tokens": _first(self.prompt_tokens, len(prompt_ids)),
            "completion_tokens": _first(self.completion_tokens, len(output_ids)),
            "finish_reason": self.finish_reason,
            "text": self.text,
            "latency": self.latency,
            "cached_tokens": self.cached_tokens,
            "reasoning_tokens": self.reasoning_tokens,
            "finished_at": self.finished_at,
        }
        return row, retokenized


def _split_messages(d: dict) -> tuple[Any, dict]:
    """The prompt messages and the trailing assistant turn ({} if none) of `messages`."""
    messages = d.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        return messages[:-1], messages[-1]
    return messages, {}


def _prompt(d: dict, messages: Any) -> tuple[list[dict] | None, str | None]:
    """Normalised prompt messages and their stable id, exactly as tasks.datasets reads a prompt row."""
    if messages is not None:
        content = {"messages": messages}  # `messages` wins over a `prompt` string kept alongside
    elif d.get("prompt") is not None:
        content = {"prompt": d["prompt"]}
    else:
        return None, None
    try:
        # The dataset loader's own row builder: the id must be the one the dataset file gives the
        # same prompt, including its normalisation of messages (dropped nulls, prompt -> user turn).
        row = datasets.build_prompt(content)
    except datasets.BadRow as bad:
        raise _BadLine(f"prompt: {bad.reason}") from None
    return row.messages, row.id


def _legacy_id(d: dict) -> str | None:
    """A legacy line's prompt id: `prompt_id`, else `id` unless it names an OpenAI completion (rows.given_id's rules
    differ: datasets give only `id`)."""
    for key in ("prompt_id", "id"):
        value = d.get(key)
        if value is None:
            continue
        if key == "id" and (
            str(d.get("object", "")).startswith("chat.completion") or str(value).startswith("chatcmpl-")
        ):
            continue  # the id of an OpenAI completion object names the answer, not the prompt
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _BadLine(f"'{key}' must be a string or int, got {type_name(value)}")
        text = str(value)
        if not text.strip():
            raise _BadLine(f"'{key}' is empty")
        return text
    return None


def _legacy_id_or_none(d: dict) -> str | None:
    try:
        return _legacy_id(d)
    except _BadLine:
        return None


def _join_reasoning(reasoning: str | None, content: str) -> str:
    if not reasoning or content.lstrip().startswith(THINK_OPEN):
        return content
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"


def _count(d: dict, usage: dict, meta: dict, key: str) -> int | None:
    return _first(
        _int(d.get(key), key), _int(usage.get(key), f"usage.{key}"), _int(meta.get(key), f"meta_info.{key}")
    )


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _obj(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _BadLine(f"'{name}' must be an object, got {type_name(value)}")
    return value


def _str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _BadLine(f"'{name}' must be a string, got {type_name(value)}")
    return value


def _int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise _BadLine(f"'{name}' must be a non-negative int, got {value!r}")
    return value


def _float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadLine(f"'{name}' must be a number, got {value!r}")
    return float(value)


def _ids(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _BadLine(f"'{name}' must be a list of token ids, got {type_name(value)}")
    # set(map(type, ...)) and min/max run in C: these lists are thousands of ids long.
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) > INT32_MAX):
        i = next(i for i, x in enumerate(value) if type(x) is not int or not 0 <= x <= INT32_MAX)
        raise _BadLine(f"'{name}[{i}]' must be a non-negative int32 token id, got {value[i]!r}")
    return value
