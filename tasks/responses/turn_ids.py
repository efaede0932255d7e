"""The ids of a conversation's turns: `<conversation>#t<k>`, k from 0 (the first assistant turn).

Generated (`turns: all`, tasks/generate/conversations.py): turn k is the target's answer to the conversation's user
turn k, and turn k + 1 is never on disk without turn k, so a dataset's conversations are its responses less those of
a turn after the first (`PartSummary.later_turns`). Passthrough records of a conversation (tasks/records/chat_masks.py)
are numbered the same way, one per assistant turn.
"""

from __future__ import annotations

import re

TURN = re.compile(r"^(?P<conversation>.+)#t(?P<turn>0|[1-9][0-9]*)$")


def turn_id(conversation: str, turn: int) -> str:
    """The id of a conversation's `turn` (0: its first assistant turn)."""
    return f"{conversation}#t{turn}"


def split_turn_id(response_id: str) -> tuple[str, int] | None:
    """(conversation id, turn) of a turn's response id; None for an id of no turn."""
    m = TURN.match(response_id)
    return (m["conversation"], int(m["turn"])) if m else None


def is_later_turn(response_id: str) -> bool:
    """A conversation's turn after its first: it adds a response, not a conversation."""
    split = split_turn_id(response_id)
    return split is not None and split[1] > 0
