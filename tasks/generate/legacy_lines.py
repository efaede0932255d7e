"""One line of a legacy `raw_responses.jsonl`, read and mapped to a response row (tasks/generate/legacy_import.py
adopts a whole file).

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
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks import datasets
from tasks.datasets.rows import id_text, type_name
from tasks.generate.prompts import chat_prompt_ids

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
INT32_MAX = 2**31 - 1


class BadLine(Exception):
    """A line that cannot be adopted: why, and whether it is unreadable (what a write cut short leaves)."""

    def __init__(self, reason: str, *, unreadable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unreadable = unreadable  # not UTF-8 / not JSON: what a write cut short leaves


def read_lines(file: Path) -> Iterator[tuple[int, bytes, bool]]:
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


def parse_line(raw: bytes, lineno: int) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(
            f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)", unreadable=True
        ) from None
    if lineno == 1:
        text = text.removeprefix("\ufeff")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadLine(f"invalid JSON ({e.msg}; column {e.colno})", unreadable=True) from None
    if not isinstance(data, dict):
        raise BadLine(f"a line must be a JSON object, got {type_name(data)}")
    return data


@dataclass
class LegacyLine:
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
    def of(cls, d: dict, fallback_time: float) -> LegacyLine:
        inner = found if isinstance(found := d.get("response"), dict) else {}
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
                raise BadLine("has no 'id' and no prompt 'messages'/'prompt' to derive one from")
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
            raise BadLine(
                "has no 'output_ids' and no response text ('text', 'response', 'content',"
                " 'choices[0].message.content', or a trailing assistant turn)"
            )
        if prompt_ids is None and messages is None:
            raise BadLine("has no 'prompt_ids'/'input_ids' and no prompt 'messages'/'prompt' to tokenise")

        finish = _first(
            d.get("finish_reason"), choice.get("finish_reason"), inner.get("finish_reason"), meta.get("finish_reason")
        )
        if isinstance(finish, dict):
            finish = finish.get("type")
        if finish is not None and not isinstance(finish, str):
            raise BadLine(f"'finish_reason' must be a string or {{type}}, got {type_name(finish)}")

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
                _int(
                    _obj(usage.get("completion_tokens_details"), "usage.completion_tokens_details").get(
                        "reasoning_tokens"
                    ),
                    "usage.completion_tokens_details.reasoning_tokens",
                ),
                _int(usage.get("reasoning_tokens"), "usage.reasoning_tokens"),
                _int(meta.get("reasoning_tokens"), "meta_info.reasoning_tokens"),
            ),
            cached_tokens=_first(
                _int(d.get("cached_tokens"), "cached_tokens"),
                _int(
                    _obj(usage.get("prompt_tokens_details"), "usage.prompt_tokens_details").get("cached_tokens"),
                    "usage.prompt_tokens_details.cached_tokens",
                ),
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
            if self.messages is None:  # never from LegacyLine.of, which wants one or the other
                raise BadLine("has no 'prompt_ids'/'input_ids' and no prompt 'messages'/'prompt' to tokenise")
            try:
                prompt_ids = chat_prompt_ids(tokenizer, self.messages)
            except Exception as e:  # a template that rejects these messages: this line's fault
                raise BadLine(f"cannot render the prompt messages with the chat template ({e})") from None
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
    if (
        isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
    ):
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
        raise BadLine(f"prompt: {bad.reason}") from None
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
        try:
            return id_text(value, key)
        except datasets.BadRow as bad:
            raise BadLine(bad.reason) from None
    return None


def legacy_id_or_none(d: dict) -> str | None:
    try:
        return _legacy_id(d)
    except BadLine:
        return None


def _join_reasoning(reasoning: str | None, content: str) -> str:
    if not reasoning or content.lstrip().startswith(THINK_OPEN):
        return content
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"


def _count(d: dict, usage: dict, meta: dict, key: str) -> int | None:
    return _first(_int(d.get(key), key), _int(usage.get(key), f"usage.{key}"), _int(meta.get(key), f"meta_info.{key}"))


def _first(*values: Any) -> Any:
    for v in values:
        if v is not None:
            return v
    return None


def _obj(value: Any, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadLine(f"'{name}' must be an object, got {type_name(value)}")
    return value


def _str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadLine(f"'{name}' must be a string, got {type_name(value)}")
    return value


def _int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise BadLine(f"'{name}' must be a non-negative int, got {value!r}")
    return value


def _float(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadLine(f"'{name}' must be a number, got {value!r}")
    return float(value)


def _ids(value: Any, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadLine(f"'{name}' must be a list of token ids, got {type_name(value)}")
    # set(map(type, ...)) and min/max run in C: these lists are thousands of ids long.
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) > INT32_MAX):
        i = next(i for i, x in enumerate(value) if type(x) is not int or not 0 <= x <= INT32_MAX)
        raise BadLine(f"'{name}[{i}]' must be a non-negative int32 token id, got {value[i]!r}")
    return value
