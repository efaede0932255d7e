"""Doctor: the target's chat template on a sample of each dataset, and where the loss mask falls.

For a passthrough dataset the records' loss mask comes from the template (tasks/records/chat_masks.py):
the first usable row is turned into its records exactly as the records stage will, and the share
of loss tokens is shown: 0% (the template drops the answers, or no end-of-turn closes them) and
100% (nothing but answers, the prompt is lost) are FAILs naming the dataset. For a dataset to
generate, the loss falls on the target's own output ids whatever the template does; what can go
wrong is the prompt: a template that leaves out the user's text, or adds no generation prompt.
Either kind WARNs when the template drops the reasoning (`reasoning_content`, or `<think>` in the
content) or the tool turns
of a sampled row: that text gets no loss, or is not in the prompt the target answers.

The same pass measures the longest rendered prompt among the first rows of each dataset to
generate (the engine check compares it with the server's context).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.common.findings import Finding
from settings.dataset import RowFormat
from tasks.datasets import BadRow, DatasetError, DatasetNotFoundError, HubDataset, Kind, iter_rows
from tasks.datasets.hub import hub_offline
from tasks.generate.prompts import chat_prompt_ids
from tasks.records.chat_masks import MaskError, OnRewrite, conversation_records

THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)  # reasoning inline in the content (Kimi, Qwen3, DeepSeek)
SAMPLE_ROWS = 200  # rows read per dataset: the sample, the rows with reasoning or tools, the longest prompt


@dataclass
class TemplateReport:
    """The findings, and the longest rendered prompt of the first SAMPLE_ROWS rows of each dataset to generate."""

    findings: list[Finding] = field(default_factory=list)
    longest_prompts: dict[str, int] = field(default_factory=dict)


def template_findings(
    tokenizer: Any,
    datasets: Sequence[tuple[str, Path | HubDataset, Kind]],
    *,
    on_rewrite: OnRewrite = "split",
    sample_rows: int = SAMPLE_ROWS,
    formats: Mapping[str, RowFormat] | None = None,
) -> TemplateReport:
    """Check the template on `datasets` ((name, path, kind) each, read in `formats[name]`, default auto); missing files
    are `eagle3 validate`'s to report. A Hub dataset is read as the run would read it, from the local cache only and
    recording nothing (HubDataset.for_a_check): one not there is a WARN (the stage that reads it downloads it), a FAIL
    when HF_HUB_OFFLINE forbids that."""
    report = TemplateReport()
    for name, path, kind in datasets:
        try:
            source = path.for_a_check() if isinstance(path, HubDataset) else path
            rows = _first_rows(source, kind, sample_rows, (formats or {}).get(name))
        except DatasetNotFoundError as exc:
            hub = isinstance(path, HubDataset)
            report.findings.append(_not_cached_finding(name, exc) if hub else _unreadable_finding(name, exc))
            continue
        except (DatasetError, OSError) as exc:
            report.findings.append(_unreadable_finding(name, exc))
            continue
        if not rows:
            report.findings.append(
                Finding(
                    f"chat template: {name}",
                    "FAIL",
                    f"no valid row in the first {sample_rows} of {path.path if isinstance(path, HubDataset) else path}",
                    "`eagle3 validate CONFIG` lists what is wrong with the rows",
                )
            )
            continue
        if kind == "passthrough":
            report.findings.append(_passthrough_finding(name, rows[0], tokenizer, on_rewrite))
        else:
            finding, longest = _prompt_findings(name, rows, tokenizer)
            report.findings.append(finding)
            report.longest_prompts[name] = longest
        dropped = _dropped_finding(name, rows, tokenizer, kind, on_rewrite)
        if dropped is not None:
            report.findings.append(dropped)
    return report


def _unreadable_finding(name: str, exc: Exception) -> Finding:
    advice = "`eagle3 validate CONFIG` lists what is wrong with the file"
    return Finding(f"chat template: {name}", "FAIL", f"cannot read a sample: {exc}"[:300], advice)


def _not_cached_finding(name: str, exc: DatasetError) -> Finding:
    """A Hub dataset not in the local cache: the stage that reads it downloads it, unless HF_HUB_OFFLINE is set."""
    detail = f"not sampled: {exc.path} {exc.reason}"[:300]
    if hub_offline():
        return Finding(f"chat template: {name}", "FAIL", detail, exc.expected or "")
    advice = f"the generate stage downloads it; to have it checked first: {exc.expected}"
    return Finding(f"chat template: {name}", "WARN", detail, advice)


def _first_rows(path: Path | HubDataset, kind: Kind, n: int, row_format: RowFormat | None) -> list[Any]:
    rows = []
    for number, row in iter_rows(path, kind, row_format):
        if number > n:
            break
        if not isinstance(row, BadRow):  # `eagle3 validate` names bad rows; the sample is the first good one
            rows.append(row)
    return rows


def _passthrough_finding(name: str, row: Any, tokenizer: Any, on_rewrite: OnRewrite) -> Finding:
    check = f"chat template: {name}"
    if row.messages is None:  # pre-tokenized: the mask is the row's own
        share = sum(row.loss_mask) / max(1, len(row.loss_mask))
        return _share_finding(check, share, f"row {row.id} (pre-tokenized)", len(row.loss_mask), from_template=False)
    try:
        records = conversation_records(row.id, row.messages, tokenizer, on_rewrite=on_rewrite)
    except MaskError as exc:
        return Finding(
            check,
            "FAIL",
            f"0% of the tokens get loss: row {row.id}: {exc.reason}"[:400],
            "fix the target's chat template (tokenizer_config.json chat_template), or give this dataset as "
            "input_ids + loss_mask",
        )
    tokens = sum(len(r.input_ids) for r in records)
    share = sum(sum(r.loss_mask) for r in records) / max(1, tokens)
    split = f"; {len(records)} records, as the template rewrites history" if len(records) > 1 else ""
    return _share_finding(check, share, f"row {row.id}{split}", tokens, from_template=True)


def _share_finding(check: str, share: float, what: str, tokens: int, *, from_template: bool) -> Finding:
    seen = f"{share:.0%} of {tokens:,} tokens get loss ({what})"
    fix = (
        "fix the target's chat template (tokenizer_config.json chat_template), or give this dataset as input_ids + "
        "loss_mask"
        if from_template
        else "fix the rows' loss_mask"
    )
    if share == 0:
        return Finding(check, "FAIL", seen + ": nothing would be trained", fix)
    if share == 1:
        return Finding(check, "FAIL", seen + ": the prompt itself would be trained on", fix)
    return Finding(check, "PASS", seen)


def _prompt_findings(name: str, rows: list[Any], tokenizer: Any) -> tuple[Finding, int]:
    check = f"chat template: {name}"
    row = rows[0]
    try:
        ids = chat_prompt_ids(tokenizer, row.messages, row.tools)
        plain = _ids(
            tokenizer.apply_chat_template(row.messages, add_generation_prompt=False, tokenize=True, return_dict=True)
        )
    except Exception as exc:  # noqa: BLE001 - jinja errors, a tokenizer without a template (ValueError)
        return Finding(
            check,
            "FAIL",
            f"the template fails on row {row.id}: {type(exc).__name__}: {exc}"[:300],
            "give the target a chat template (tokenizer_config.json chat_template)",
        ), 0
    longest = len(ids)
    for other in rows[1:]:
        try:
            longest = max(longest, len(chat_prompt_ids(tokenizer, other.messages, other.tools)))
        except Exception:  # noqa: BLE001, S112 - the first row's failure is the finding; the others are only measured
            continue
    text = tokenizer.decode(ids)
    last_user = next(m["content"] for m in reversed(row.messages) if m["role"] == "user")
    probe = _probe(last_user)
    seen = f"row {row.id}: prompt of {len(ids):,} tokens; loss on the target's output only"
    if probe and probe not in text:
        return Finding(
            check,
            "WARN",
            f"{seen}, but the rendered prompt does not hold the user's text ({probe[:30]!r}...)",
            "check the target's chat template",
        ), longest
    if ids == plain:
        return Finding(
            check,
            "WARN",
            f"{seen}, but add_generation_prompt adds nothing: the target would continue the user's turn",
            "use a template with a generation prompt",
        ), longest
    return Finding(check, "PASS", seen), longest


def _dropped_finding(name: str, rows: list[Any], tokenizer: Any, kind: Kind, on_rewrite: OnRewrite) -> Finding | None:
    """A WARN when the first sampled row with reasoning or tool turns loses them; None if nothing is lost.

    Passthrough: reasoning is lost when it is in no record's loss span, a tool result when it is in
    no record. A prompt: a tool result not in the rendered prompt (earlier turns' reasoning left out
    of a prompt is the target's own convention, as it saw history in training: not a loss).
    """
    for row in rows:
        messages = row.messages or []
        texts = (
            []
            if kind != "passthrough"
            else [
                ("reasoning", m["reasoning_content"])
                for m in messages
                if m.get("role") == "assistant"
                and isinstance(m.get("reasoning_content"), str)
                and m["reasoning_content"].strip()
            ]
        )
        if kind == "passthrough":
            texts += [
                ("reasoning", think)
                for m in messages
                if m.get("role") == "assistant"
                for think in THINK.findall(m.get("content") or "")
                if think.strip()
            ]
        texts += [
            ("tool result", m["content"])
            for m in messages
            if m.get("role") == "tool" and isinstance(m.get("content"), str) and m["content"].strip()
        ]
        if not texts:
            continue
        try:
            if kind == "passthrough":
                records = conversation_records(row.id, messages, tokenizer, on_rewrite=on_rewrite)
                trained = " ".join(
                    tokenizer.decode([t for t, m in zip(r.input_ids, r.loss_mask) if m]) for r in records
                )
                shown = " ".join(tokenizer.decode(r.input_ids) for r in records)
            else:
                trained = shown = tokenizer.decode(chat_prompt_ids(tokenizer, messages))
        except Exception:  # noqa: BLE001 - a template failure is reported by the checks above
            return None
        lost = sorted({what for what, text in texts if _probe(text) not in (trained if what == "reasoning" else shown)})
        if not lost:
            return None
        where = "gets no loss in any record" if kind == "passthrough" else "is not in the prompt the target answers"
        return Finding(
            f"chat template: {name}",
            "WARN",
            f"row {row.id}: the template drops its {' and '.join(lost)} text, which {where}",
            "if it matters, use a template that renders it, or pre-tokenize the rows",
        )
    return None


def _probe(text: str) -> str:
    """A piece of `text` to look for in a rendering (its first 40 characters, stripped)."""
    return text.strip()[:40]


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # transformers 4 returned a list
    return [int(t) for t in ids]
