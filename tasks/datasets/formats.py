"""Row formats: the shapes public datasets come in, each read into the canonical row that rows.py checks.

A dataset's `format` (settings/dataset.py `RowFormat`, the row format keys of each dataset of the run config) names
one of:

- `messages`: today's canonical row, `messages` [{role, content}] (or `prompt`; passthrough also `input_ids` +
  `loss_mask`); roles other than system/user/assistant/tool are renamed through ROLE_ALIASES and `roles:`.
- `sharegpt`: `conversations` [{from, value}], `from` renamed the same way (human -> user, gpt -> assistant).
- `alpaca`: `instruction`, optional `input` (appended to the instruction after a blank line, as the Alpaca template
  puts it below the instruction), optional `output` (the assistant turn; needed for passthrough).
- `columns`: one turn per named column: `system_field` (optional), `prompt_field`, `response_field` (passthrough).
- `ultrachat`: `data`, a list of strings alternating user, assistant, ... (UltraChat as first published).
- `glaive`: `system` + `chat` (glaiveai/glaive-function-calling-v2): `chat` is one string of turns, each opening with
  a role marker at the start of a line (`USER:` -> user, `ASSISTANT:` -> assistant, `FUNCTION RESPONSE:` -> tool);
  every `<|endoftext|>` is removed and each turn stripped; `system` without its leading `SYSTEM:` is the system turn
  (none if empty). Nothing else is parsed: an assistant's `<functioncall> {...}` stays text, not `tool_calls`.

Each `from_*` function turns a raw row into {"id"?, "messages": [...]} (format messages: the row itself, roles
renamed), or raises BadRow naming the row's own fields. Only role and content are kept from the turns of a converted
format, so a converted row and the same conversation written as `messages` are the same row with the same id. For a
prompt (generate) the conversation is cut with rows.prompt_length, the one rule of every format: one that ends with
an assistant turn ends at its last user turn, and the cut turns are not checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from settings.dataset import RowFormat
from tasks.datasets.errors import DatasetError
from tasks.datasets.raw import COLUMNS, EXPECTED
from tasks.datasets.rows import (
    GENERATE_ROLES,
    BadRow,
    Kind,
    given_id,
    keys_note,
    listed_objects,
    prompt_length,
    type_name,
)

# Role names public sets use for the four roles: ShareGPT's `from` (human, gpt; chatgpt, bing, bard in
# ShareGPT_Vicuna), Gemini's `model`. A dataset's `roles:` adds to these and wins over them.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


@dataclass(frozen=True)
class Shape:
    """A dataset's row format, resolved: the format, the fields it reads, and whether `auto` detected it."""

    format: str  # messages | sharegpt | alpaca | columns | ultrachat | glaive
    auto: bool = False
    id_field: str = "id"
    roles: Mapping[str, str] = field(default_factory=lambda: dict(ROLE_ALIASES))
    prompt_field: str | None = None  # format columns
    response_field: str | None = None
    system_field: str | None = None
    added_roles: Mapping[str, str] = field(default_factory=dict)  # the dataset's own roles:, for describe()

    @classmethod
    def of(cls, fmt: RowFormat, detected: str | None = None, **fields: Any) -> Shape:
        """The shape `fmt` configures, or (`detected` given) the one auto found, with its id field and roles."""
        if detected is None:
            detected = fmt.format
            fields = {k: getattr(fmt, k) for k in ("prompt_field", "response_field", "system_field")}
        return cls(
            format=detected,
            auto=fmt.format == "auto",
            id_field=fmt.id_field,
            roles={**ROLE_ALIASES, **fmt.roles},
            added_roles=dict(fmt.roles),
            **fields,
        )

    def describe(self) -> str:
        """One line for `eagle3 validate`: `columns (auto: problem -> user, solution -> assistant)`."""
        how = "auto" if self.auto else "configured"
        details = {
            "messages": "",
            "sharegpt": "conversations: from -> role, value -> content",
            "alpaca": "instruction + input -> user, output -> assistant",
            "ultrachat": "data: user, assistant, ... alternating",
            "glaive": "system -> system, chat: USER: -> user, ASSISTANT: -> assistant, FUNCTION RESPONSE: -> tool",
            "columns": ", ".join(f"{name} -> {role}" for role, name in self._turn_fields() if name),
        }[self.format]
        extras = [details] if details else []
        if self.id_field != "id":
            extras.append(f"id: {self.id_field}")
        if self.added_roles:
            extras.append("roles: " + ", ".join(f"{k} -> {v}" for k, v in self.added_roles.items()))
        return f"{self.format} ({how}{': ' if extras else ''}{'; '.join(extras)})"

    def expected(self, kind: str) -> str:
        """What a row of this format looks like, appended to its row errors."""
        if self.format == "messages":
            return EXPECTED[kind]
        needs = {
            "sharegpt": "'conversations' [{from, value}] (from: human, gpt, system, tool, or a name mapped with roles:)"
            + (" with a gpt turn" if kind == "passthrough" else ""),
            "alpaca": "'instruction' (string), optional 'input', and "
            + ("'output' (the response)" if kind == "passthrough" else "optional 'output' (cut: the target answers)"),
            "ultrachat": "'data', a list of strings alternating user, assistant, ..., starting with the user",
            "glaive": "'chat', a string of turns each opening a line with USER:, ASSISTANT: or FUNCTION RESPONSE:, "
            "and optional 'system' (string)",
            "columns": " and ".join(f"'{name}'" for _, name in self._turn_fields() if name) + " (strings)",
        }[self.format]
        return f"format {self.format}: each row needs {needs}"

    def columns(self, source: Path, kind: str, schema: pa.Schema) -> list[str]:
        """The columns of `schema` this format reads; a file without the ones it needs is a file error."""
        names = schema.names
        if self.format == "messages":
            wanted = (self.id_field, *COLUMNS[kind][1:])
            content = [c for c in COLUMNS[kind][1:] if c in names]
            if not set(content) - {"loss_mask", "tools"}:
                need = "'messages' or 'prompt'" if kind == "generate" else "'messages' or 'input_ids' + 'loss_mask'"
                raise DatasetError(
                    source,
                    None,
                    f"has no {need} column (columns: {', '.join(names) or 'none'})",
                    expected=self.expected(kind),
                )
        else:
            wanted = (self.id_field, *self._fields())
            needed = self._needed(kind)
            missing = [c for c in needed if c not in names]
            if missing:
                raise DatasetError(
                    source,
                    None,
                    f"has no {', '.join(repr(c) for c in missing)} column for format {self.format}"
                    f" (columns: {', '.join(names) or 'none'})",
                    expected=self.expected(kind),
                )
        return [c for c in dict.fromkeys(wanted) if c in names]

    def convert(self, data: dict, kind: Kind) -> dict:
        """The canonical row of `data` (rows.build_prompt / build_passthrough read it); BadRow if it is not one."""
        return CONVERTERS[self.format](data, kind, self)

    def _turn_fields(self) -> list[tuple[str, str | None]]:
        return [("system", self.system_field), ("user", self.prompt_field), ("assistant", self.response_field)]

    def _fields(self) -> tuple[str, ...]:
        """Every field the format reads besides the id."""
        return {
            "sharegpt": ("conversations",),
            "alpaca": ("instruction", "input", "output"),
            "ultrachat": ("data",),
            "glaive": ("system", "chat"),
            "columns": tuple(name for _, name in self._turn_fields() if name),
        }[self.format]

    def _needed(self, kind: str) -> tuple[str, ...]:
        """The fields without which no row of the format can be read."""
        if self.format == "alpaca":
            return ("instruction", "output") if kind == "passthrough" else ("instruction",)
        if self.format == "columns":
            return tuple(n for n in (self.prompt_field, self.response_field if kind == "passthrough" else None) if n)
        if self.format == "glaive":
            return ("chat",)
        return self._fields()


# One converter per format: raw row -> canonical row.


def from_messages(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format messages: the row itself, its role names mapped and its id taken from id_field."""
    out = dict(data)
    messages = out.get("messages")
    if isinstance(messages, list):
        out["messages"] = [_renamed(m, shape.roles) for m in messages]
    if shape.id_field != "id":
        out.pop("id", None)
        _put_id(out, data, shape)
    return out


def from_sharegpt(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format sharegpt: `conversations` [{from, value}] -> messages."""
    conversations = _present(data, "conversations")
    turns = []
    for where, turn in listed_objects(conversations, "conversations", "from, value"):
        turns.append(
            _Turn(_role(turn.get("from"), f"{where}.from", shape), turn.get("value"), f"{where}.value", f"{where}.from")
        )
    return _conversation(turns, data, kind, shape, "conversations")


def from_alpaca(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format alpaca: `instruction` + `input` -> the user turn, `output` -> the assistant turn."""
    instruction = _present(data, "instruction")
    if isinstance(instruction, str) and not instruction.strip():
        raise BadRow("'instruction' is empty")
    extra = data.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRow(f"'input' must be a string, got {type_name(extra)}")
    user = f"{instruction}\n\n{extra}" if isinstance(instruction, str) and extra and extra.strip() else instruction
    turns = [_Turn("user", user, "instruction")]
    if kind == "passthrough" or data.get("output") is not None:
        turns.append(_Turn("assistant", data.get("output"), "output"))
    return _conversation(turns, data, kind, shape, "row")


def from_columns(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format columns: system_field, prompt_field, response_field -> one turn each."""
    if shape.prompt_field is None:  # RowFormat refuses it; a Shape built by hand could lack it
        raise BadRow("format columns needs prompt_field", expected="set prompt_field: COLUMN in the dataset's config")
    turns = []
    if shape.system_field is not None:
        system = data.get(shape.system_field)
        if system is not None and not isinstance(system, str):
            raise BadRow(f"'{shape.system_field}' must be a string, got {type_name(system)}")
        if system and system.strip():
            turns.append(_Turn("system", system, shape.system_field))
    turns.append(_Turn("user", _present(data, shape.prompt_field), shape.prompt_field))
    if kind == "passthrough" and shape.response_field is None:
        raise BadRow("format columns needs response_field for a passthrough row (the column holding the response)")
    if shape.response_field is not None and (kind == "passthrough" or data.get(shape.response_field) is not None):
        turns.append(_Turn("assistant", data.get(shape.response_field), shape.response_field))
    return _conversation(turns, data, kind, shape, "row")


def from_ultrachat(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format ultrachat: `data` [user, assistant, user, ...] -> messages."""
    texts = _present(data, "data")
    if not isinstance(texts, list):
        raise BadRow(f"'data' must be a list of strings (user, assistant, ... alternating), got {type_name(texts)}")
    if not texts:
        raise BadRow("'data' is empty")
    turns = [_Turn("assistant" if i % 2 else "user", text, f"data[{i}]") for i, text in enumerate(texts)]
    return _conversation(turns, data, kind, shape, "data")


# glaive-function-calling-v2's role markers, each opening a line of `chat`, and the role of the turn it opens.
GLAIVE_ROLES = {"USER": "user", "ASSISTANT": "assistant", "FUNCTION RESPONSE": "tool"}
_GLAIVE_MARKER = re.compile(r"^(USER|ASSISTANT|FUNCTION RESPONSE):", re.MULTILINE)
_GLAIVE_END = "<|endoftext|>"


def from_glaive(data: dict, kind: Kind, shape: Shape) -> dict:
    """Format glaive: `system` (minus `SYSTEM:`) -> the system turn, `chat` split on its role markers -> the turns."""
    chat = _present(data, "chat")
    if not isinstance(chat, str):
        raise BadRow(f"'chat' must be a string of USER:/ASSISTANT:/FUNCTION RESPONSE: turns, got {type_name(chat)}")
    if not chat.replace(_GLAIVE_END, "").strip():
        raise BadRow("'chat' is empty")
    turns = []
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRow(f"'system' must be a string, got {type_name(system)}")
    if system:
        text = system.strip()
        text = text[len("SYSTEM:") :].strip() if text.startswith("SYSTEM:") else text
        if text:
            turns.append(_Turn("system", text, "system"))
    markers = list(_GLAIVE_MARKER.finditer(chat))
    before = chat[: markers[0].start()] if markers else chat
    if before.replace(_GLAIVE_END, "").strip():
        raise BadRow(
            f"'chat' does not open with a role marker (USER:, ASSISTANT:, FUNCTION RESPONSE:): {before.strip()[:40]!r}"
        )
    for i, marker in enumerate(markers):
        end = markers[i + 1].start() if i + 1 < len(markers) else len(chat)
        text = chat[marker.end() : end].replace(_GLAIVE_END, "").strip()
        where = f"chat turn {i + 1} ({marker.group(1)}:)"
        turns.append(_Turn(GLAIVE_ROLES[marker.group(1)], text, where, where))
    if not any(t.role == "user" for t in turns):
        raise BadRow("'chat' has no USER: turn")
    return _conversation(turns, data, kind, shape, "chat")


CONVERTERS: dict[str, Callable[[dict, Kind, Shape], dict]] = {
    "messages": from_messages,
    "sharegpt": from_sharegpt,
    "alpaca": from_alpaca,
    "columns": from_columns,
    "ultrachat": from_ultrachat,
    "glaive": from_glaive,
}


@dataclass(slots=True)
class _Turn:
    role: str
    content: Any
    where: str  # the row's field holding the content, as errors name it
    role_where: str | None = None  # the field holding the role, where the format has one


def _conversation(turns: list[_Turn], data: dict, kind: Kind, shape: Shape, name: str) -> dict:
    """The canonical row of converted turns: cut for a prompt, each kept turn checked, the id from id_field."""
    if kind == "generate":
        keep = prompt_length([{"role": t.role} for t in turns])
        if not keep:
            raise BadRow(f"{_named(name)} has no user turn (the prompt to answer)")
        turns = turns[:keep]
    for turn in turns:
        if kind == "generate" and turn.role not in GENERATE_ROLES:
            raise BadRow(
                f"'{turn.role_where or turn.where}' is a {turn.role} turn; a prompt to generate from has "
                f"{', '.join(GENERATE_ROLES)} turns only"
            )
        if turn.content is None:
            raise BadRow(f"'{turn.where}' is missing")
        if not isinstance(turn.content, str):
            raise BadRow(f"'{turn.where}' must be a string, got {type_name(turn.content)}")
        if turn.role != "tool" and not turn.content.strip():
            raise BadRow(f"'{turn.where}' is empty")
    if kind == "generate" and turns[-1].role != "user":
        raise BadRow(f"{_named(name)} must end with a user turn (the prompt to answer), got {turns[-1].role!r} last")
    if kind == "passthrough" and not any(t.role == "assistant" for t in turns):
        raise BadRow(f"{_named(name)} has no assistant turn; a passthrough row must already hold the response")
    out: dict = {"messages": [{"role": t.role, "content": t.content} for t in turns]}
    _put_id(out, data, shape)
    return out


def _named(name: str) -> str:
    return "the row" if name == "row" else f"'{name}'"


def _present(data: dict, key: str) -> Any:
    value = data.get(key)
    if value is None:
        raise BadRow(f"'{key}' is missing{keys_note(data)}")
    return value


def _role(value: Any, where: str, shape: Shape) -> str:
    if value is None:
        raise BadRow(f"'{where}' is missing")
    if not isinstance(value, str):
        raise BadRow(f"'{where}' must be a string, got {type_name(value)}")
    role = shape.roles.get(value)
    if role is None:
        raise BadRow(
            f"'{where}' is {value!r}, not a role name this format knows",
            expected=f"map it in the dataset's config: roles: {{{value}: user}} (or system, assistant, tool)",
        )
    return role


def _renamed(message: Any, roles: Mapping[str, str]) -> Any:
    role = message.get("role") if isinstance(message, dict) else None
    if isinstance(role, str) and roles.get(role, role) != role:
        return {**message, "role": roles[role]}
    return message


def _put_id(out: dict, data: dict, shape: Shape) -> None:
    # The raw value, checked under its own field's name: the loader tells an int id from the same digits as a string.
    if given_id(data, shape.id_field) is not None:
        out["id"] = data[shape.id_field]
