"""Row rules: a parsed row (a dict from any file format) becomes a PromptRow or a PassthroughRow, or raises BadRow.

What a valid row of each kind is, how ids are given or derived (`stable_id`), and the checks on
messages, token ids and loss masks: tasks/datasets/__init__.py has the contract.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

Kind = Literal["generate", "passthrough"]

GENERATE_ROLES = ("system", "user", "assistant")
PASSTHROUGH_ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class PromptRow:
    """A prompt to send to the target: the conversation so far, ending with a user turn."""

    id: str
    messages: list[dict]
    tools: list[dict] | None = None  # tool definitions, given to the chat template (`tools=`) with the messages


@dataclass(slots=True)
class PassthroughRow:
    """A finished example: either a conversation with assistant turns, or token ids + mask."""

    id: str
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


@dataclass(slots=True)
class Reject:
    """A row skipped under on_bad_row="skip": where it was, its id if it had one, and why."""

    path: Path
    row: int
    id: str | None
    reason: str
    raw: str
    cause: str | None = None  # tasks.responses.rejects.CAUSES; None: derived from the stage and reason

    @property
    def location(self) -> str:
        """`file line N` for JSON Lines, `file row N` otherwise, as DatasetError says it."""
        unit = "line" if Path(self.path).suffix in (".jsonl", ".json") else "row"
        return f"{self.path} {unit} {self.row}"


class RowShape(Protocol):
    """A dataset's row format as a loaded dataset and its errors carry it (formats.Shape, configured or detected):
    what they give of it is its one line for `eagle3 validate`."""

    def describe(self) -> str: ...


RowT = TypeVar("RowT", PromptRow, PassthroughRow)


@dataclass
class LoadedDataset(Generic[RowT]):
    """Valid rows (first occurrence of each id), the rejects, how many duplicates were dropped, the row format read."""

    rows: list[RowT]
    rejects: list[Reject]
    duplicates: int
    path: Path
    shape: RowShape | None = None  # the dataset's row format, configured or detected; None: no row was read


def stable_id(content: Mapping[str, Any]) -> str:
    """First 16 hex chars of sha256 over the canonical JSON of a row's content fields."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: never crash on a lone surrogate hiding in an extra message key.
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class BadRow(Exception):
    """One row is not valid: why, and what a valid row looks like (the loader adds the file and row)."""

    def __init__(self, reason: str, expected: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expected = expected


def build_prompt(data: dict) -> PromptRow:
    """A prompt row from a parsed object (normalised messages, stable id); BadRow if it is not one."""
    messages, prompt = data.get("messages"), data.get("prompt")
    if messages is not None and prompt is not None:
        if prompt != first_user_content(messages):
            raise BadRow(
                "has both 'messages' and 'prompt', and 'prompt' is not the first user turn's content; give one"
            )
        prompt = None  # ultrachat_200k: `prompt` repeats the first user turn; the conversation is `messages`
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRow(f"'prompt' must be a string, got {type_name(prompt)}")
        if not prompt.strip():
            raise BadRow("'prompt' is empty")
        _check_unicode(prompt, "'prompt'")
        messages = [{"role": "user", "content": prompt}]
    elif messages is not None:
        if isinstance(messages, list) and messages:
            keep = prompt_length(messages)
            if not keep:
                raise BadRow("'messages' must end with a user turn (the prompt to answer); it has none")
            messages = messages[:keep]
        messages = _messages(messages, GENERATE_ROLES)
        if messages[-1]["role"] != "user":
            raise BadRow(
                f"'messages' must end with a user turn (the prompt to answer), got {messages[-1]['role']!r} last"
            )
    else:
        raise BadRow(f"missing 'messages' or 'prompt'{keys_note(data)}")
    row_id = given_id(data)
    row = PromptRow(id=row_id if row_id is not None else stable_id({"messages": messages}), messages=messages)
    row.tools = _tools(data.get("tools"))
    return row


def _tools(value: Any) -> list[dict] | None:
    """A row's `tools`: a list of tool definitions (objects), or a JSON string of one, as Hub sets often store it;
    None or an empty list: no tools."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise BadRow(f"'tools' is a string but not JSON ({exc.msg} at character {exc.pos})") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise BadRow(f"'tools' must be a list of tool definitions or a JSON string of one, got {type_name(value)}")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise BadRow(f"'tools[{i}]' must be an object (a tool definition), got {type_name(tool)}")
    return value


def build_passthrough(data: dict) -> PassthroughRow:
    """A passthrough row from a parsed object (messages, or input_ids + loss_mask); BadRow if it is not one."""
    has_messages = data.get("messages") is not None
    has_ids = data.get("input_ids") is not None
    has_mask = data.get("loss_mask") is not None
    if has_messages and (has_ids or has_mask):
        raise BadRow("has both 'messages' and 'input_ids'/'loss_mask'; give one")
    if has_messages:
        messages = _messages(data["messages"], PASSTHROUGH_ROLES)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("'messages' has no assistant turn; a passthrough row must already hold the response")
        row_id = given_id(data)
        return PassthroughRow(id=row_id if row_id is not None else stable_id({"messages": messages}), messages=messages)
    if not has_ids and not has_mask:
        raise BadRow(f"missing 'messages' or 'input_ids' + 'loss_mask'{keys_note(data)}")
    if not has_ids:
        raise BadRow("'input_ids' is missing; a 'loss_mask' needs the token ids it masks")
    if not has_mask:
        raise BadRow("'loss_mask' is missing; 'input_ids' needs a 'loss_mask' of the same length (1 = train on it)")
    input_ids = _token_ids(data["input_ids"])
    loss_mask = _loss_mask(data["loss_mask"], len(input_ids))
    row_id = given_id(data)
    if row_id is None:
        row_id = stable_id({"input_ids": input_ids, "loss_mask": loss_mask})
    return PassthroughRow(id=row_id, input_ids=input_ids, loss_mask=loss_mask)


BUILDERS: dict[str, Callable[[dict], Any]] = {"generate": build_prompt, "passthrough": build_passthrough}


def prompt_length(turns: list) -> int:
    """How many leading turns of a conversation are the prompt: one that ends with an assistant turn ends at its last
    user turn (0: it has none); any other is kept whole. The one rule for prompt rows of every format."""
    if not turns or _role(turns[-1]) != "assistant":
        return len(turns)
    return next((i + 1 for i in range(len(turns) - 1, -1, -1) if _role(turns[i]) == "user"), 0)


def first_user_content(messages: Any) -> Any:
    """The content of the first user turn of `messages` (None if there is none or it is not a list of objects)."""
    if not isinstance(messages, list):
        return None
    return next((m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"), None)


def _role(turn: Any) -> Any:
    return turn.get("role") if isinstance(turn, dict) else None


def listed_objects(value: Any, name: str, keys: str) -> Iterator[tuple[str, dict]]:
    """Each object of the list `value` (the row's `name`) with where it stands (`name[i]`); BadRow for a value that is
    not a list, an empty list, or an item that is not an object {keys}. Lazily: an item's own checks come first."""
    if not isinstance(value, list):
        raise BadRow(f"'{name}' must be a list of {{{keys}}} objects, got {type_name(value)}")
    if not value:
        raise BadRow(f"'{name}' is empty")
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise BadRow(f"'{where}' must be an object {{{keys}}}, got {type_name(item)}")
        yield where, item


def _messages(value: Any, roles: tuple[str, ...]) -> list[dict]:
    out = []
    for where, m in listed_objects(value, "messages", "role, content"):
        role = _string_key(m, where, "role")
        if role not in roles:
            other = f" (another name for a role: map it with roles: {{{role}: ...}})"
            hint = "" if role in PASSTHROUGH_ROLES else other
            raise BadRow(f"'{where}.role' must be one of {', '.join(roles)}, got {role!r}{hint}")
        content = _string_key(m, where, "content")
        empty_ok = role == "tool" or (role == "assistant" and bool(m.get("tool_calls") or m.get("reasoning_content")))
        if not empty_ok and not content.strip():
            raise BadRow(f"'{where}.content' is empty")
        _check_unicode(content, f"'{where}.content'")
        message = {"role": role, "content": content}
        message.update((k, v) for k, v in m.items() if k not in message and v is not None)
        out.append(message)
    return out


def _string_key(message: dict, where: str, key: str) -> str:
    """`message[key]`, which must be there and be a string."""
    if key not in message:
        raise BadRow(f"'{where}.{key}' is missing")
    value = message[key]
    if not isinstance(value, str):
        raise BadRow(f"'{where}.{key}' must be a string, got {type_name(value)}")
    return value


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadRow(f"'input_ids' must be a list of ints, got {type_name(value)}")
    if not value:
        raise BadRow("'input_ids' is empty")
    # set(map(type, ...)) and min() run in C: these lists can be 100k tokens long.
    if set(map(type, value)) != {int}:
        i = next(i for i, x in enumerate(value) if type(x) is not int)
        raise BadRow(f"'input_ids[{i}]' must be a non-negative int, got {type_name(value[i])}")
    if min(value) < 0:
        i = next(i for i, x in enumerate(value) if x < 0)
        raise BadRow(f"'input_ids[{i}]' must be a non-negative int, got {value[i]}")
    return value


def _loss_mask(value: Any, length: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRow(f"'loss_mask' must be a list of 0/1, got {type_name(value)}")
    if len(value) != length:
        raise BadRow(f"'loss_mask' has {len(value)} entries but 'input_ids' has {length}; they must be the same length")
    types = set(map(type, value))
    if not types <= {int, bool}:
        i = next(i for i, x in enumerate(value) if type(x) not in (int, bool))
        raise BadRow(f"'loss_mask[{i}]' must be 0 or 1, got {type_name(value[i])}")
    if not set(value) <= {0, 1}:
        i = next(i for i, x in enumerate(value) if x not in (0, 1))
        raise BadRow(f"'loss_mask[{i}]' must be 0 or 1, got {value[i]!r}")
    if not any(value):
        raise BadRow("'loss_mask' has no 1s; at least one token must carry the loss")
    # Bools become 0/1 so that a mask hashes and stores the same from JSON and from Arrow.
    return list(map(int, value)) if bool in types else value


def given_id(data: dict, key: str = "id") -> str | None:
    """The row's id from `key` as a string, None if it has none; BadRow for one that is not a string or int."""
    value = data.get(key)
    return None if value is None else id_text(value, key, empty="is empty; leave it out to get a content hash")


def id_text(value: Any, key: str, *, empty: str = "is empty") -> str:
    """An id given in `key` (a string or int, not blank) as a string; BadRow for any other value."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRow(f"'{key}' must be a string or int, got {type_name(value)}")
    text = str(value)
    if not text.strip():
        raise BadRow(f"'{key}' {empty}")
    return text


def loose_id(data: Any, key: str = "id") -> str | None:
    """The id of a rejected row, if it had a usable one (in `key`, the dataset's id_field)."""
    if isinstance(data, dict):
        value = data.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return utf8(str(value))
    return None


def _check_unicode(text: str, where: str) -> None:
    # json.loads accepts lone surrogate escapes ("\ud83d"), which no tokenizer or Parquet
    # writer accepts later: reject them here, with the row.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(f"{where} is not valid Unicode (unpaired surrogate at character {e.start})") from None


def keys_note(data: dict) -> str:
    """` (row has: a, b)`: the keys that are not null, for errors about a missing field."""
    present = [k for k, v in data.items() if v is not None]
    return f" (row has: {', '.join(map(str, present))})" if present else ""


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__
    )


def utf8(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8") if _has_surrogates(text) else text


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True
