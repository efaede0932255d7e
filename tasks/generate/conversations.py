"""Multi-turn regeneration (`turns: all`): each user turn of a conversation answered by the target, in order.

A conversation's turn k is one request and one response, id `<conversation id>#t<k>` (k from 0,
tasks/responses/turn_ids.py): its prompt is the chat template applied to the conversation's leading system turns, its
user turns 0..k and the target's own answers to user turns 0..k-1 (the dataset's assistant turns are not used). So
every turn is a response like any other: exactly once by id, counted by the budget, one record (its prompt ids + its
output ids, the loss on the output ids only). One record per turn is the honest shape: a template may render an earlier
answer differently from the ids the target produced (Kimi-K2.5's drops the reasoning of earlier turns), so a single
record of the whole conversation would train on re-rendered text.

Turn k + 1 is sent only after turn k is recorded whole (finish_reason `stop`, or ending with a stop token). A turn
cut by the length limit is recorded and ends the conversation there (its answer is unfinished, so nothing follows
it); a turn that becomes a reject (refused, too long, aborted by the server too often) ends it too, and is retried
with the reject on a later run as any reject is. Turns are recorded in order, and a part holds a buffer's rows in
order, so on disk turn k + 1 is never without turn k: a resumed conversation continues at its first turn not on
disk. Only a part moved aside by hand (a damaged one) can leave a hole; such a conversation is not continued (its
later turns were answered after the lost one) and is named in the log.

Tools: a conversation is regenerated up to its first tool call. The user turns before the first `tool` message
(or assistant turn with `tool_calls`) are answered; what follows is not sent (the target's answer would need the
tool's result for its own call, which no one runs here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tasks.datasets import PromptRow
from tasks.responses.checkpoints import is_whole
from tasks.responses.turn_ids import split_turn_id, turn_id


@dataclass
class Conversation:
    """A conversation being regenerated: its fixed turns, and the target's answers so far."""

    id: str
    head: list[dict[str, Any]]  # leading system turns
    users: list[dict[str, Any]]  # the user turns to answer, in order
    tools: list[dict] | None = None  # the row's tool definitions, in every turn's prompt
    answers: list[str] = field(default_factory=list)  # the target's answers to users[: len(answers)]

    @property
    def next_turn(self) -> int:
        """The turn to send next (0-based: the index of its user turn)."""
        return len(self.answers)

    @property
    def finished(self) -> bool:
        return len(self.answers) >= len(self.users)

    def prompt(self) -> PromptRow:
        """The next turn's request: the conversation so far, with the target's answers, ending at the next user turn."""
        messages = list(self.head)
        for user, answer in zip(self.users, self.answers):
            messages += [user, {"role": "assistant", "content": answer}]
        messages.append(self.users[len(self.answers)])
        return PromptRow(id=turn_id(self.id, self.next_turn), messages=messages, tools=self.tools)


def conversation(row: PromptRow) -> Conversation:
    """The conversation of a dataset row: its leading system turns and its user turns up to the first tool call."""
    head: list[dict[str, Any]] = []
    users: list[dict[str, Any]] = []
    for m in row.messages:
        role = m.get("role")
        if role == "tool" or (role == "assistant" and m.get("tool_calls")):
            break
        if role == "system" and not users:
            head.append({"role": "system", "content": m["content"]})
        elif role == "user":
            users.append({"role": "user", "content": m["content"]})
    return Conversation(row.id, head, users, tools=row.tools)


def answer_text(tokenizer: Any, output_ids: list[int], stop_ids: Iterable[int]) -> str:
    """A recorded answer as the next turn's history sees it: its text, without the stop token that ended it
    (the chat template writes the end of an assistant turn itself)."""
    ids = list(output_ids)
    if ids and ids[-1] in set(stop_ids):
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))


@dataclass
class Resumed:
    """Where a `turns: all` dataset stands on disk."""

    queue: list[PromptRow]  # each unfinished conversation's next turn, in file order
    conversations: dict[str, Conversation]  # by the response id of the turn now queued
    turns: int  # user turns the dataset will regenerate at most (the progress total)
    ended: int  # conversations that ended early: a turn cut by length, or a reject
    empty: list[PromptRow]  # rows with no user turn before their first tool call
    holes: list[str]  # ids of missing turns whose conversation has later turns on disk (a part moved aside)


def resume(
    rows: list[PromptRow],
    recorded: dict[str, tuple[int | None, str]],
    standing: set[str],
    tokenizer: Any,
    stop_ids: list[int],
    answers: Callable[[set[str]], dict[str, list[int]]],
) -> Resumed:
    """Each conversation continued from its turns on disk: `recorded` maps turn ids to (last output id,
    finish_reason) (tasks.responses.checkpoints.turn_finishes), `standing` holds the ids of rejects that stand,
    `stop_ids` are the stop tokens generate sends, `answers` reads the output_ids of the turn ids it is given.

    Only the conversations that go on need their answers (the next turn's history): those are read and decoded, the
    answers of conversations that ended or are complete are not (a rerun late in a run would decode all of them)."""
    out = Resumed([], {}, 0, 0, [], [])
    last_on_disk: dict[str, int] = {}
    for key in recorded:
        split = split_turn_id(key)
        if split is not None:
            last_on_disk[split[0]] = max(split[1], last_on_disk.get(split[0], -1))
    going_on: list[tuple[Conversation, list[str]]] = []
    for row in rows:
        conv = conversation(row)
        if not conv.users:
            if row.id not in standing:
                out.empty.append(row)
            continue
        out.turns += len(conv.users)
        answered: list[str] = []
        while len(answered) < len(conv.users):
            k = len(answered)
            key = turn_id(conv.id, k)
            if key in standing:
                out.ended += 1
                break
            if key not in recorded and last_on_disk.get(conv.id, -1) > k:
                out.holes.append(key)
                out.ended += 1
                break
            if key not in recorded:
                going_on.append((conv, answered))
                break
            last, finish_reason = recorded[key]
            if not is_whole([] if last is None else [last], finish_reason, stop_ids):
                out.ended += k + 1 < len(conv.users)
                break
            answered.append(key)
    read = answers({key for _, keys in going_on for key in keys})
    for conv, keys in going_on:
        conv.answers.extend(answer_text(tokenizer, read[key], stop_ids) for key in keys)
        key = turn_id(conv.id, conv.next_turn)
        out.conversations[key] = conv
        out.queue.append(conv.prompt())
    return out
