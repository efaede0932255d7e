"""Training records (input_ids + loss_mask) for passthrough `messages` rows, masked by token ids.

Only for passthrough conversations that arrive as `messages`. Finished *generated* responses are
never re-rendered here or anywhere: their records are `prompt_ids + output_ids` exactly as the
target produced them, because a chat template may drop or rewrite reasoning of earlier turns.

A passthrough conversation has no generated ids, so its training text has to come from the
target's own chat template. Turn boundaries are found in token ids, never in string offsets: for
the assistant message at index i,

    before  = render(messages[:i], add_generation_prompt=True)   # what the model is fed
    through = render(messages[:i + 1])                            # ... plus what it generated

`before` must be a token prefix of `through`; the loss span is `through[len(before):]` cut after
its last end-of-turn token (the eos the model emits; template glue after it, such as a newline,
gets no loss, nor does the role header, which belongs to the generation prompt).

Stable templates render every `through` as a prefix of the whole conversation: then the
conversation is one record with every assistant span masked. Templates that rewrite history
(Kimi/Qwen3 drop the `<think>...</think>` of assistant turns before the last user message) make
the whole rendering differ from what the model saw while generating an earlier turn; masking that
rewritten text would train on text the model never produced in that context. Such conversations
are split into one record per assistant turn (`through` of that turn, loss on that turn only), or
rejected with `on_rewrite="reject"`. Nothing is ever masked on a guess: every inconsistency raises
`MaskError`.

Cost: two renders per assistant turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jinja2

from tasks.responses.turn_ids import turn_id

OnRewrite = Literal["split", "reject"]


@dataclass(slots=True)
class TokenizedTurns:
    """One training record built from a conversation: token ids and a 0/1 loss mask of equal length."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


class MaskError(ValueError):
    """A conversation whose loss mask cannot be derived safely; `reason` says which turn, why, and the fix.

    `row_id` is the conversation's id (None when unknown), `turn` the 0-based message index at
    fault (None when the problem is not one turn's).
    """

    def __init__(self, reason: str, *, row_id: str | None = None, turn: int | None = None) -> None:
        self.reason = reason
        self.row_id = row_id
        self.turn = turn
        super().__init__(f"{row_id}: {reason}" if row_id is not None else reason)

    def __reduce__(self):
        return (_rebuild_mask_error, (self.reason, self.row_id, self.turn))


def _rebuild_mask_error(reason: str, row_id: str | None, turn: int | None) -> MaskError:
    return MaskError(reason, row_id=row_id, turn=turn)


def conversation_records(
    row_id: str,
    messages: list[dict],
    tokenizer: Any,
    *,
    on_rewrite: OnRewrite = "split",
    end_of_turn_ids: list[int] | None = None,
) -> list[TokenizedTurns]:
    """Training records for one passthrough conversation, with loss on assistant turns only.

    Returns one record (id `row_id`) when the template renders the conversation stably, else
    (history rewritten, `on_rewrite="split"`) one record per assistant turn with ids
    `f"{row_id}#t{k}"`, k the 0-based index among assistant turns. Messages after the last
    assistant turn carry no loss and are ignored. `end_of_turn_ids` are the tokens that close an
    assistant turn (default: the tokenizer's eos). Raises `MaskError` when the mask cannot be
    derived safely, and `ValueError` for a bad `on_rewrite` or a tokenizer without eos.
    """
    if on_rewrite not in ("split", "reject"):
        raise ValueError(f"on_rewrite must be 'split' or 'reject', got {on_rewrite!r}")
    eot = _end_of_turn_ids(tokenizer, end_of_turn_ids)

    assistant_at = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not assistant_at:
        raise MaskError(
            "the conversation has no assistant turn, so there is nothing to put loss on;"
            " passthrough 'messages' rows need at least one assistant message",
            row_id=row_id,
        )
    messages = messages[: assistant_at[-1] + 1]  # trailing user/tool turns: no loss, no record text

    # Per assistant turn: its rendering through the turn, and where its loss span lies in it.
    throughs: list[list[int]] = []
    spans: list[tuple[int, int]] = []
    for i in assistant_at:
        _check_content(messages[i], i, row_id)
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, turn=i, row_id=row_id)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, turn=i, row_id=row_id)
        if through[: len(before)] != before:
            raise MaskError(
                f"assistant message {i}: the chat template renders the generation prompt differently"
                f" from the header of a finished assistant turn (the prompt is not a token prefix of"
                f" the conversation through turn {i}), so the turn's tokens cannot be located;"
                f" fix the template or pre-tokenize this row as input_ids + loss_mask",
                row_id=row_id,
                turn=i,
            )
        throughs.append(through)
        spans.append((len(before), _span_end(through, len(before), eot, i, row_id)))

    full = throughs[-1]  # the whole conversation, trailing non-assistant turns dropped
    unstable = [k for k, through in enumerate(throughs) if full[: len(through)] != through]
    if not unstable:
        mask = [0] * len(full)
        for start, end in spans:
            mask[start:end] = [1] * (end - start)
        return [TokenizedTurns(row_id, list(full), mask)]

    if on_rewrite == "reject":
        i = assistant_at[unstable[0]]
        raise MaskError(
            f"assistant message {i}: the chat template rewrites this turn when later turns follow"
            f" (e.g. drops its reasoning), so the whole conversation is not the text the model saw"
            f" while generating it; use on_rewrite='split' to keep it as one record per assistant turn",
            row_id=row_id,
            turn=i,
        )
    records = []
    for k, (through, (start, end)) in enumerate(zip(throughs, spans)):
        mask = [0] * len(through)
        mask[start:end] = [1] * (end - start)
        records.append(TokenizedTurns(turn_id(row_id, k), list(through), mask))
    return records


def _end_of_turn_ids(tokenizer: Any, end_of_turn_ids: list[int] | None) -> frozenset[int]:
    if end_of_turn_ids is not None:
        if not end_of_turn_ids:
            raise ValueError("end_of_turn_ids is empty: name the token(s) that close an assistant turn")
        return frozenset(int(t) for t in end_of_turn_ids)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "the tokenizer has no eos token: pass end_of_turn_ids (the token that closes an assistant turn)"
        )
    return frozenset(int(e) for e in eos) if isinstance(eos, (list, tuple)) else frozenset([int(eos)])


def _check_content(message: dict, i: int, row_id: str) -> None:
    """An assistant turn with nothing in it would train only on the end-of-turn token: refuse it."""
    content = message.get("content")
    if isinstance(content, str) and content.strip():
        return
    if message.get("tool_calls") or message.get("reasoning_content"):
        return  # the template renders these; _span_end still checks that something was rendered
    raise MaskError(
        f"assistant message {i} has empty content, so it has nothing to train on;"
        f" drop the turn or the row, or fill in the content",
        row_id=row_id,
        turn=i,
    )


def _render(tokenizer: Any, messages: list[dict], *, add_generation_prompt: bool, turn: int, row_id: str) -> list[int]:
    try:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
        )
    except jinja2.TemplateError as e:  # e.g. the template's raise_exception on an unsupported role
        raise MaskError(
            f"assistant message {turn}: the chat template failed on the conversation up to this turn"
            f" ({e}); fix the messages or pre-tokenize this row as input_ids + loss_mask",
            row_id=row_id,
            turn=turn,
        ) from e
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # transformers 4 returned a list
    return [int(t) for t in ids]


def _span_end(through: list[int], start: int, eot: frozenset[int], i: int, row_id: str) -> int:
    """End (exclusive) of the loss span of the turn rendered at through[start:]: just past its last end-of-turn."""
    end = next((j + 1 for j in range(len(through) - 1, start - 1, -1) if through[j] in eot), None)
    if end is None:
        raise MaskError(
            f"assistant message {i}: no end-of-turn token (ids {sorted(eot)}) closes the rendered turn,"
            f" so the model would never learn to stop; pass end_of_turn_ids matching the template",
            row_id=row_id,
            turn=i,
        )
    if all(t in eot for t in through[start:end]):
        raise MaskError(
            f"assistant message {i} renders to nothing but its end-of-turn token (the template drops"
            f" its content), so it has nothing to train on; drop the turn or pre-tokenize the row",
            row_id=row_id,
            turn=i,
        )
    return end
