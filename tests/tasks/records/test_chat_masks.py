"""Loss masks of passthrough conversations, checked against an independent text-offset reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.target.tiny_tokenizer import CHAT_TEMPLATE, IM_END
from tasks.records.chat_masks import MaskError, TokenizedTurns, conversation_records

SAMPLE = Path(__file__).resolve().parents[3] / "data" / "samples" / "passthrough_chat.jsonl"
GEN_PROMPT = "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
# Sample conversations with reasoning in an assistant turn before the last user turn: the template
# drops that reasoning when it renders the whole conversation, so these must be split.
REWRITTEN = {"pt-001", "pt-004", "pt-005", "pt-013", "pt-018", "pt-020", "pt-022", "pt-027"}


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]


def _tokenizer_with_template(tiny_target_dir, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)  # a fresh copy: the shared one stays as is
    tok.chat_template = template
    return tok


# ---------------------------------------------------------------------------------------------
# Independent reference: render the whole conversation to TEXT once, walk the known role headers
# to find each assistant turn's characters, then mark tokens by their character offsets. It uses
# no prefix rendering; what the template does to history is spelled out here by hand.


def _header(role: str) -> str:
    return f"<|im_{'system' if role == 'tool' else role}|>{role}<|im_middle|>"


def _rendered_content(messages: list[dict], i: int) -> str:
    """What the tiny template prints for message i: earlier assistant turns lose their reasoning."""
    last_user = max((j for j, m in enumerate(messages) if m["role"] == "user"), default=-1)
    content = messages[i]["content"]
    if messages[i]["role"] == "assistant" and i < last_user:
        if content.lstrip().startswith("<think>") and "</think>" in content:
            content = content.split("</think>", 1)[1].lstrip()
    return content


def reference_mask(tokenizer, messages: list[dict], loss_turns: set[int] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) with loss on the content + closing <|im_end|> of assistant messages in loss_turns."""
    if loss_turns is None:
        loss_turns = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []  # (content start, content end, im_end end) in characters
    pos = 0
    for i, m in enumerate(messages):
        header, content = _header(m["role"]), _rendered_content(messages, i)
        assert text.startswith(header, pos), (i, text[pos : pos + 40])
        pos += len(header)
        assert text.startswith(content, pos), (i, text[pos : pos + 40])
        start, pos = pos, pos + len(content)
        assert text.startswith(IM_END, pos), (i, text[pos : pos + 40])
        if i in loss_turns:
            spans.append((start, pos, pos + len(IM_END)))
        pos += len(IM_END)
    assert pos == len(text)

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = []
    for a, b in enc["offset_mapping"]:
        for c0, c1, _ in spans:
            assert not (a < c0 < b or a < c1 < b), "a token straddles a turn boundary"
        mask.append(int(any((c0 <= a and b <= c1) or (a, b) == (c1, e1) for c0, c1, e1 in spans)))
    return list(enc["input_ids"]), mask


def _masked_text(tokenizer, record: TokenizedTurns) -> str:
    return tokenizer.decode([t for t, m in zip(record.input_ids, record.loss_mask) if m])


# ---------------------------------------------------------------------------------------------


def test_rewritten_samples_are_those_with_reasoning_before_the_last_user_turn(rows):
    def rewritten(messages):
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        return any(m["role"] == "assistant" and m["content"].startswith("<think>") for m in messages[:last_user])

    assert {row["id"] for row in rows if rewritten(row["messages"])} == REWRITTEN
    assert len(rows) == 32


def test_every_sample_matches_the_reference_in_split_mode(tokenizer, rows):
    stable = split = 0
    for row in rows:
        messages = row["messages"]
        records = conversation_records(row["id"], messages, tokenizer)
        if row["id"] not in REWRITTEN:
            stable += 1
            assert [r.id for r in records] == [row["id"]]
            ids, mask = reference_mask(tokenizer, messages)
            assert records[0].input_ids == ids, row["id"]
            assert records[0].loss_mask == mask, row["id"]
        else:
            split += 1
            turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            assert [r.id for r in records] == [f"{row['id']}#t{k}" for k in range(len(turns))]
            for record, i in zip(records, turns):
                ids, mask = reference_mask(tokenizer, messages[: i + 1], loss_turns={i})
                assert record.input_ids == ids, record.id
                assert record.loss_mask == mask, record.id
    assert (stable, split) == (24, 8)


def test_reject_mode_keeps_stable_samples_and_names_the_first_rewritten_turn(tokenizer, rows):
    for row in rows:
        messages = row["messages"]
        if row["id"] not in REWRITTEN:
            [record] = conversation_records(row["id"], messages, tokenizer, on_rewrite="reject")
            assert (record.input_ids, record.loss_mask) == reference_mask(tokenizer, messages)
            continue
        with pytest.raises(MaskError) as err:
            conversation_records(row["id"], messages, tokenizer, on_rewrite="reject")
        first = next(
            i for i, m in enumerate(messages) if m["role"] == "assistant" and m["content"].startswith("<think>")
        )
        assert err.value.turn == first
        assert err.value.row_id == row["id"]
        assert f"assistant message {first}" in err.value.reason
        assert "rewrites" in err.value.reason and "on_rewrite='split'" in err.value.reason


def test_masked_tokens_decode_to_exactly_the_assistant_text(tokenizer, rows):
    by_id = {row["id"]: row["messages"] for row in rows}

    # Stable, two assistant turns: both contents, each closed by <|im_end|>, nothing else.
    messages = by_id["pt-010"]
    [record] = conversation_records("pt-010", messages, tokenizer)
    assert _masked_text(tokenizer, record) == messages[2]["content"] + IM_END + messages[4]["content"] + IM_END
    assert sum(record.loss_mask) == 75

    # Rewritten: each split record trains its own turn with the reasoning it was generated with,
    # while the history in front of it is what the template shows (earlier reasoning dropped).
    messages = by_id["pt-001"]
    first, second = conversation_records("pt-001", messages, tokenizer)
    assert messages[1]["content"].startswith("<think>")
    assert _masked_text(tokenizer, first) == messages[1]["content"] + IM_END
    assert _masked_text(tokenizer, second) == messages[3]["content"] + IM_END
    assert "<think>" not in tokenizer.decode(second.input_ids)
    assert [sum(first.loss_mask), sum(second.loss_mask)] == [97, 47]
    # The role header is the prompt's, not the model's: the token before each span has no loss.
    start = first.loss_mask.index(1)
    assert tokenizer.decode(first.input_ids[:start]).endswith(IM_END + "<|im_assistant|>assistant<|im_middle|>")


def test_single_turn_conversation_is_one_record(tokenizer, rows):
    row = next(r for r in rows if r["id"] == "pt-002")  # system, user, assistant with reasoning
    [record] = conversation_records(row["id"], row["messages"], tokenizer)
    assert record.id == "pt-002"
    assert len(record.input_ids) == len(record.loss_mask)
    assert _masked_text(tokenizer, record) == row["messages"][2]["content"] + IM_END
    assert record.loss_mask[-1] == 1 and record.input_ids[-1] == tokenizer.eos_token_id
    assert record.input_ids == tokenizer.apply_chat_template(row["messages"], return_dict=True)["input_ids"]


def test_trailing_non_assistant_turns_are_ignored(tokenizer, rows):
    messages = next(r for r in rows if r["id"] == "pt-012")["messages"]
    extended = messages + [{"role": "user", "content": "Thanks!"}]
    assert conversation_records("x", extended, tokenizer) == conversation_records("x", messages, tokenizer)
    # Without the drop the trailing user turn would make the last assistant turn lose its reasoning.
    assert conversation_records("x", extended, tokenizer)[0].loss_mask == reference_mask(tokenizer, messages)[1]


def test_conversation_without_assistant_turn_is_an_error(tokenizer):
    with pytest.raises(MaskError) as err:
        conversation_records(
            "r1", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], tokenizer
        )
    assert isinstance(err.value, ValueError)
    assert err.value.turn is None and "no assistant turn" in err.value.reason
    assert str(err.value).startswith("r1: ")


def test_empty_assistant_content_is_an_error_naming_the_turn(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "  "},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hello."},
    ]
    with pytest.raises(MaskError) as err:
        conversation_records("r2", messages, tokenizer)
    assert err.value.turn == 1 and "assistant message 1 has empty content" in err.value.reason


def test_generation_prompt_unlike_the_assistant_header_is_an_error(tiny_target_dir):
    tok = _tokenizer_with_template(
        tiny_target_dir, CHAT_TEMPLATE.replace(GEN_PROMPT, GEN_PROMPT.replace(">assistant<", ">bot<"))
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    with pytest.raises(MaskError) as err:
        conversation_records("r3", messages, tok)
    assert err.value.turn == 1
    assert "generation prompt differently from the header" in err.value.reason


def test_generation_prompt_that_opens_reasoning(tiny_target_dir):
    # Kimi-K2.5 style: the prompt ends with <think>. A turn that starts with its reasoning fits
    # (the prompt's <think> gets no loss: the model did not generate it); one without does not.
    tok = _tokenizer_with_template(
        tiny_target_dir,
        CHAT_TEMPLATE.replace(GEN_PROMPT, GEN_PROMPT.replace("<|im_middle|>{%", "<|im_middle|><think>{%")),
    )
    reasoning = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>Easy.</think>\n\n4."}]
    [record] = conversation_records("r4", reasoning, tok)
    assert _masked_text(tok, record) == "Easy.</think>\n\n4." + IM_END
    with pytest.raises(MaskError) as err:
        conversation_records("r5", [reasoning[0], {"role": "assistant", "content": "4."}], tok)
    assert err.value.turn == 1


def test_template_glue_after_the_end_of_turn_gets_no_loss(tiny_target_dir, rows):
    tok = _tokenizer_with_template(
        tiny_target_dir, CHAT_TEMPLATE.replace("<|im_end|>{%- endfor", "<|im_end|>{{ '\\n' }}{%- endfor")
    )
    messages = next(r for r in rows if r["id"] == "pt-010")["messages"]
    [record] = conversation_records("pt-010", messages, tok)
    assert _masked_text(tok, record) == messages[2]["content"] + IM_END + messages[4]["content"] + IM_END
    eos = tok.eos_token_id
    for j, (t, m) in enumerate(zip(record.input_ids, record.loss_mask)):
        if m and t == eos:
            assert tok.decode(record.input_ids[j + 1 : j + 2]) == "\n" and record.loss_mask[j + 1] == 0


def test_end_of_turn_ids_that_never_close_a_turn_is_an_error(tokenizer, rows):
    messages = next(r for r in rows if r["id"] == "pt-003")["messages"]
    im_user = tokenizer.convert_tokens_to_ids("<|im_user|>")
    with pytest.raises(MaskError) as err:
        conversation_records("pt-003", messages, tokenizer, end_of_turn_ids=[im_user])
    assert err.value.turn == 1 and "no end-of-turn token" in err.value.reason
    # Naming the real end-of-turn explicitly is the same as the eos default.
    explicit = conversation_records("pt-003", messages, tokenizer, end_of_turn_ids=[tokenizer.eos_token_id])
    assert explicit == conversation_records("pt-003", messages, tokenizer)


def test_bad_on_rewrite_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="on_rewrite"):
        conversation_records("r6", [{"role": "assistant", "content": "x"}], tokenizer, on_rewrite="drop")  # type: ignore[arg-type]
