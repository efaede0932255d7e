"""The dev server with an EAGLE-3 draft: SGLang's `--speculative-*` flags, `spec_verify_ct`, and the
engine-measured acceptance equal to the in-process eval (models/eval/speculative_decoding.py) on the same prompts.

The draft is an untrained (random) one, exported as SGLang reads it: the point is equality, not quality.
`avg_spec_accept_length` is folded every `decode_log_interval` decode batches as SGLang 0.5.23's
metrics_reporter.py does (`folded_avg`); tests that compare it with the eval serve with interval 1.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from emulators.dev_server.app import create_app
from emulators.dev_server.cli import main
from emulators.dev_server.speculative import Speculative
from models.draft.eagle3 import DraftStep, Eagle3Draft
from models.draft.vocab import draft_vocab
from models.eval.speculative_decoding import evaluate_acceptance, greedy_generate, speculative_decode
from models.export.eagle3 import load_exported_draft
from tests import drafts

CONTEXT = 512
NUM_STEPS = 3
MAX_NEW = 24
D = 256  # draft vocab smaller than the target's: d2t is not the identity


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


def export_random_draft(model, out_dir, *, draft_vocab_size: int = D):
    return drafts.export_random_draft(model, out_dir, draft_vocab_size=draft_vocab_size)


def folded_avg(kept: list[int], interval: int = 40) -> float | None:
    """SGLang 0.5.23's avg_spec_accept_length after verify rounds that kept `kept` tokens, one decode batch of
    size 1 each, in serving order: only the rounds up to the last multiple of `interval` are folded in."""
    folded = kept[: len(kept) // interval * interval]
    return sum(folded) / len(folded) if folded else None


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """A random draft over the target's embedding, exported in float32 (models/export/eagle3.py)."""
    model, _ = target
    return export_random_draft(model, tmp_path_factory.mktemp("draft") / "final")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Prompts of varied length; the last one is a single token."""
    model, _ = target
    g = torch.Generator().manual_seed(3)
    v = model.config.vocab_size
    out = [torch.randint(8, v, (n,), generator=g).tolist() for n in (4, 7, 12, 3, 9, 5)]
    return out + [[int(torch.randint(8, v, (1,), generator=g))]]


def _spec_app(tiny_target_dir, draft_dir, **kw):
    return create_app(
        tiny_target_dir,
        context_length=CONTEXT,
        max_batch_size=4,
        model_name="tiny",
        speculative=Speculative.from_flags(
            draft_model_path=draft_dir,
            algorithm="EAGLE3",
            num_steps=NUM_STEPS,
            eagle_topk=1,
            num_draft_tokens=NUM_STEPS + 1,
        ),
        **kw,
    )


@pytest.fixture(scope="module")
def spec_server(tiny_target_dir, draft_dir, serve_app):
    with serve_app(_spec_app(tiny_target_dir, draft_dir)) as url:
        yield url


def _generate(url: str, prompts: list[list[int]], params: dict) -> list[dict]:
    with httpx.Client(base_url=url, timeout=120) as client:
        r = client.post(
            "/generate",
            json={"input_ids": prompts, "sampling_params": params, "rid": [f"r{i}" for i in range(len(prompts))]},
        )
    assert r.status_code == 200, r.text
    return r.json()


GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


def test_engine_acceptance_equals_in_process_eval(serve_app, tiny_target_dir, draft_dir, target, prompts):
    """A fresh server against evaluate_acceptance; folding after every round (decode_log_interval 1), its
    avg_spec_accept_length covers exactly these prompts."""
    model, tok = target
    with serve_app(_spec_app(tiny_target_dir, draft_dir, decode_log_interval=1)) as url:
        outs = _generate(url, prompts, GREEDY)
        with httpx.Client(base_url=url, timeout=30) as client:
            info = client.get("/get_server_info").json()
            assert client.get("/server_info").json()["internal_states"] == info["internal_states"]

    # The eval loads the same export the same way, with the target's eos as its stop set.
    draft = load_exported_draft(draft_dir, dtype=torch.float32).eval()
    eos = {tok.eos_token_id}
    ev = evaluate_acceptance(model, draft, prompts, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids=eos)

    # Per request: identical tokens, and spec_verify_ct is the number of verify rounds.
    assert [o["output_ids"] for o in outs] == ev.outputs
    rounds = [
        len(speculative_decode(model, draft, p, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids=eos)[1])
        for p in prompts
    ]
    verify = [o["meta_info"]["spec_verify_ct"] for o in outs]
    assert verify == rounds
    completion = [o["meta_info"]["completion_tokens"] for o in outs]
    assert sum(verify) == ev.rounds > len(prompts)
    assert sum(completion) == ev.new_tokens

    # SGLang's per-request figure counts the prefill token too; the eval's per-round mean does not.
    assert sum(completion) / sum(verify) == pytest.approx(ev.acceptance_length + len(prompts) / ev.rounds, abs=1e-12)
    assert (sum(completion) - len(prompts)) / sum(verify) == ev.acceptance_length
    assert info["internal_states"][0]["avg_spec_accept_length"] == ev.acceptance_length
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_draft_model_path"] == str(draft_dir)
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (
        NUM_STEPS,
        1,
        NUM_STEPS + 1,
    )


@pytest.mark.parametrize(
    "params",
    [
        {"ignore_eos": True},
        {"stop_token_ids": "FROM_OUTPUT"},
        {"max_new_tokens": 1},
        {"max_new_tokens": 0},
    ],
)
def test_output_with_draft_equals_output_without(serve_app, spec_server, tiny_target_dir, prompts, params):
    """Greedy speculative decoding changes nothing but spec_verify_ct: tokens, text and finish reasons."""
    params = {**GREEDY, **params}
    with serve_app(create_app(tiny_target_dir, context_length=CONTEXT, max_batch_size=4, model_name="tiny")) as plain:
        if params.get("stop_token_ids") == "FROM_OUTPUT":  # a token each greedy output reaches mid-way
            free = _generate(plain, prompts, {**GREEDY, "ignore_eos": True})
            params["stop_token_ids"] = sorted({o["output_ids"][MAX_NEW // 2] for o in free})
        without = _generate(plain, prompts, params)
    with_draft = _generate(spec_server, prompts, params)
    for a, b in zip(with_draft, without):
        verify = a["meta_info"].pop("spec_verify_ct")
        assert "spec_verify_ct" not in b["meta_info"]
        assert 0 <= verify <= max(0, len(a["output_ids"]) - 1)
        for result in (a, b):  # the two times
            result["meta_info"].pop("e2e_latency")
            result["meta_info"].pop("response_sent_to_client_ts")
        assert a == b
    if params.get("stop_token_ids"):
        assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in with_draft)


def test_an_eagle3_1_draft_is_served_as_each_sglang_version_reads_it(target, tmp_path):
    from emulators.dev_server.draft import load_served_draft
    from emulators.sglang_protocol.versions import V05, SGLangVersion

    model, _ = target
    final = drafts.export_random_draft(model, tmp_path / "final", draft_vocab_size=D, variant="eagle3.1")
    # 0.5.23 builds fc_norm and hands each step the post-norm state, as the export says
    new = load_served_draft(final, model, V05)
    assert new.config.variant == "eagle3.1" and new.fc_norm is not None
    # 0.4.10 reads neither key and drops the fc_norm tensors: the same weights, drafted as EAGLE-3
    old = load_served_draft(final, model, SGLangVersion("0.4"))
    assert old.config.variant == "eagle3" and old.fc_norm is None
    assert torch.equal(old.fc.weight, new.fc.weight)
    ids, aux = torch.tensor([[9, 10, 11]]), torch.randn(1, 3, 3 * model.config.hidden_size)
    with torch.no_grad():
        assert not torch.allclose(old(ids, aux).logits, new(ids, aux).logits)


def test_sampling_is_refused_with_a_draft(spec_server, prompts):
    with httpx.Client(base_url=spec_server, timeout=30) as client:
        r = client.post(
            "/generate", json={"input_ids": prompts[0], "sampling_params": {"temperature": 0.7, "max_new_tokens": 4}}
        )
        assert r.status_code == 400
        assert "greedy sampling only" in r.json()["error"]["message"]
        # top_k 1 is greedy (SGLang's rule) and is served.
        ok = client.post(
            "/generate",
            json={"input_ids": prompts[0], "sampling_params": {"temperature": 0.7, "top_k": 1, "max_new_tokens": 4}},
        )
        assert ok.status_code == 200 and ok.json()["meta_info"]["spec_verify_ct"] >= 1
        assert client.get("/health_generate").status_code == 200


def test_flags_are_checked_with_sglang_names(draft_dir, tmp_path):
    ok = Speculative.from_flags(draft_model_path=draft_dir, num_steps=2)
    assert ok == Speculative(draft_model_path=str(draft_dir), num_steps=2)
    assert Speculative.from_flags(draft_model_path=None) is None
    bad = [
        (dict(draft_model_path=draft_dir, num_steps=2, eagle_topk=4), "--speculative-eagle-topk must be 1"),
        (dict(draft_model_path=draft_dir, num_steps=2, num_draft_tokens=4), "must be --speculative-num-steps + 1 = 3"),
        (dict(draft_model_path=draft_dir, num_steps=2, algorithm="NGRAM"), "must be EAGLE3"),
        (dict(draft_model_path=draft_dir), "--speculative-num-steps is required"),
        (dict(draft_model_path=draft_dir, num_steps=0), ">= 1"),
        (dict(draft_model_path=tmp_path, num_steps=2), "no config.json"),
        (
            dict(draft_model_path=None, num_steps=2),
            "--speculative-num-steps given without --speculative-draft-model-path",
        ),
    ]
    for kwargs, fragment in bad:
        with pytest.raises(ValueError, match=fragment.replace("+", r"\+")):
            Speculative.from_flags(**kwargs)


def draft_flags(target_dir, draft_dir, *more: str) -> list[str]:
    """The dev server's flags for `target_dir` with the draft at `draft_dir` and 3 steps, then `more`."""
    flags = ["--model", str(target_dir), "--speculative-draft-model-path", str(draft_dir)]
    return [*flags, "--speculative-num-steps", "3", *more]


def test_module_cli_refuses_bad_speculative_flags(tiny_target_dir, draft_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        main(draft_flags(tiny_target_dir, draft_dir, "--speculative-eagle-topk", "2"))
    assert exc.value.code == 2
    assert "--speculative-eagle-topk must be 1" in capsys.readouterr().err


def test_eagle3_serve_dev_refuses_bad_speculative_flags(tiny_target_dir, draft_dir):
    from typer.testing import CliRunner

    from cli.app import app

    flags = draft_flags(tiny_target_dir, draft_dir, "--speculative-num-draft-tokens", "3")
    result = CliRunner().invoke(app, ["serve-dev", *flags])
    assert result.exit_code == 2
    assert "must be --speculative-num-steps + 1 = 4" in result.output


class PartlyRightDraft(Eagle3Draft):
    """The exported draft's weights, its logits pushed to be right exactly where `hit(position)` says.

    The draft step at draft position p proposes the token at p + 2 of the prompt + greedy sequence
    (its input is the token at p + 1): where hit(p), +1e4 on that token (surely proposed), else -1e4
    (surely not). The sequence is recognised by the extend from an empty cache (its first tokens).
    """

    def setup(self, seqs: list[list[int]], hit) -> PartlyRightDraft:
        self.seqs, self.hit, self.seq = seqs, hit, None
        return self

    def forward(self, input_ids, hidden, position_ids=None, cache=None, *, target_vocab_logits=False):
        past = 0 if cache is None else len(cache)
        step = super().forward(input_ids, hidden, position_ids, cache)
        ids = input_ids[0].tolist()
        if past == 0:
            found = [s for s in self.seqs if s[1 : len(ids) + 1] == ids]
            assert len(found) == 1, "an extend from an empty cache starts at a known prompt"
            self.seq = found[0]
        t2d_index = torch.cumsum(self.t2d.long(), 0) - 1  # target id -> draft index
        logits = step.logits.clone()
        for j, p in enumerate(range(past, past + len(ids))):
            if p + 2 < len(self.seq):
                tok = self.seq[p + 2]
                assert self.t2d[tok], "scripted tokens must be in the draft vocab"
                logits[0, j, t2d_index[tok]] += 1e4 if self.hit(p) else -1e4
        return DraftStep(logits=logits, hidden=step.hidden, cache=step.cache)


_PATTERN = "1101110111101101011110011011101"  # hits and misses: rounds accept 0..K tokens


def test_partly_right_draft_counts_rounds_like_the_eval(serve_app, tiny_target_dir, draft_dir, target, prompts):
    """Rounds that accept 0..K drafts: spec_verify_ct and avg_spec_accept_length still match the eval."""
    model, _ = target
    seqs = [p + greedy_generate(model, p, max_new_tokens=MAX_NEW + NUM_STEPS + 2, eos_token_ids=set()) for p in prompts]
    loaded = load_exported_draft(draft_dir, dtype=torch.float32)
    draft = PartlyRightDraft(loaded.config)
    draft.load_state_dict(loaded.state_dict())
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=model.config.vocab_size)
    assert int((counts > 0).sum()) <= D
    draft.set_draft_vocab(*draft_vocab(counts.numpy(), model.config.vocab_size, D))
    draft = draft.eval().setup(seqs, lambda p: _PATTERN[p % len(_PATTERN)] == "1")

    app = _spec_app(tiny_target_dir, draft_dir, decode_log_interval=1)
    app.state.batcher.draft = draft  # white-box: the same scripted draft object serves and is evaluated
    params = {**GREEDY, "ignore_eos": True}
    with serve_app(app) as url:
        outs = _generate(url, prompts, params)
        with httpx.Client(base_url=url, timeout=30) as client:
            avg = client.get("/server_info").json()["internal_states"][0]["avg_spec_accept_length"]
    ev = evaluate_acceptance(model, draft, prompts, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids=set())
    rounds = [
        speculative_decode(model, draft, p, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids=set())[1]
        for p in prompts
    ]

    assert (
        [o["output_ids"] for o in outs] == ev.outputs == [s[len(p) : len(p) + MAX_NEW] for s, p in zip(seqs, prompts)]
    )
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [len(r) for r in rounds]
    accepted = {r.accepted for rs in rounds for r in rs}
    assert accepted == set(range(NUM_STEPS + 1)), accepted  # every outcome occurs
    assert 1.5 < ev.acceptance_length < NUM_STEPS + 1
    assert avg == ev.acceptance_length
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    verify = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert (completion - len(prompts)) / verify == ev.acceptance_length


@pytest.mark.multiprocess
@pytest.mark.parametrize("entry", ["module", "eagle3"])
def test_server_process_with_draft_flags(entry, tiny_target_dir, draft_dir, target, prompts, tmp_path):
    """`python -m emulators.dev_server`, `eagle3 serve-dev` with SGLang's flags serve the draft as the eval decodes."""
    import sys
    from pathlib import Path

    from tasks.runtime.ports import free_port
    from tasks.serving.launch import ServerProcess

    model, tok = target
    port = free_port()
    start = (
        [sys.executable, "-m", "emulators.dev_server"]
        if entry == "module"
        else [str(Path(sys.executable).parent / "eagle3"), "serve-dev"]
    )
    command = [
        *start,
        "--model",
        str(tiny_target_dir),
        "--port",
        str(port),
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft_dir),
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
    ]
    with ServerProcess(command, f"http://127.0.0.1:{port}", log_path=tmp_path / "server.log") as server:
        server.wait_healthy(timeout_s=60)
        outs = _generate(server.url, prompts[:3], GREEDY)
        with httpx.Client(base_url=server.url, timeout=30) as client:
            info = client.get("/server_info").json()
    draft = load_exported_draft(draft_dir, dtype=torch.float32).eval()
    expected = [
        speculative_decode(model, draft, p, num_steps=2, max_new_tokens=MAX_NEW, eos_token_ids={tok.eos_token_id})
        for p in prompts[:3]
    ]
    assert [o["output_ids"] for o in outs] == [out for out, _ in expected]
    assert [o["meta_info"]["spec_verify_ct"] for o in outs] == [len(rounds) for _, rounds in expected]
    assert info["speculative_num_steps"] == 2 and info["speculative_num_draft_tokens"] == 3
    # SGLang's default decode_log_interval (40): only the rounds up to the last multiple of 40 are folded in.
    kept = [r.kept for _, rs in expected for r in rs]
    assert len(kept) >= 40, "enough rounds for a fold"
    assert info["internal_states"][0].get("avg_spec_accept_length") == folded_avg(kept)


def engine_decode(url, chosen, params, vocab_size: int, select=None):
    """tasks/serving/eval_server.py's decode of `chosen` at `url`: 2 at once, no key, a 30 s outage window."""
    import asyncio

    from tasks.serving.client import RetryPolicy
    from tasks.serving.eval_server import decode_prompts

    return asyncio.run(
        decode_prompts(
            url,
            chosen,
            params,
            concurrency=2,
            retry=RetryPolicy(outage_window_s=30),
            request_timeout_s=60,
            api_key=None,
            auth_hint="",
            vocab_size=vocab_size,
            select=select,
        )
    )


def test_engine_eval_through_the_dev_server_equals_the_in_process_eval(
    serve_app, spec_server, tiny_target_dir, target, draft_dir, prompts
):
    """tasks/serving/eval_server.py and tasks/eval/engine_report.py end to end at real servers: with the draft, then
    without.

    Both counts: SGLang's and the per-round one.
    """
    from models.eval.prompts import EvalPrompt
    from tasks.eval.engine_report import compare_with_hf, engine_report

    model, tok = target
    eval_prompts = [EvalPrompt("A" if i % 2 else "B", f"p{i}", p) for i, p in enumerate(prompts)]
    params = {**GREEDY, "stop_token_ids": [tok.eos_token_id], "no_stop_trim": True}

    def decode(url, check=False):
        def select(limits, client):  # the check runs before anything is sent
            client.check_draft(limits, NUM_STEPS)
            return eval_prompts, {}

        return engine_decode(url, eval_prompts, params, model.config.vocab_size, select=select if check else None)

    with_draft = decode(spec_server, check=True)
    with serve_app(create_app(tiny_target_dir, context_length=CONTEXT, max_batch_size=4, model_name="tiny")) as plain:
        with pytest.raises(ValueError, match="serves no EAGLE-3 draft"):
            decode(plain, check=True)
        without = decode(plain)
    report = engine_report(with_draft, without, NUM_STEPS, concurrency=2)

    draft = load_exported_draft(draft_dir, dtype=torch.float32).eval()
    ev = evaluate_acceptance(
        model, draft, prompts, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids={tok.eos_token_id}
    )
    overall = report["overall"]
    assert overall["completion_tokens"] == ev.new_tokens and overall["verify_rounds"] == ev.rounds
    assert overall["per_round"] == round(ev.acceptance_length, 4)
    assert overall["acceptance_length"] == round(ev.new_tokens / ev.rounds, 4)
    assert report["outputs_differ_without_draft"] == 0 and overall["speedup"] > 0
    assert set(report["datasets"]) == {"A", "B"}
    assert sum(d["verify_rounds"] for d in report["datasets"].values()) == ev.rounds
    rounds = [
        len(
            speculative_decode(
                model, draft, p, num_steps=NUM_STEPS, max_new_tokens=MAX_NEW, eos_token_ids={tok.eos_token_id}
            )[1]
        )
        for p in prompts
    ]
    hf = {
        "acceptance_length": round(ev.acceptance_length, 4),
        "per_prompt": [
            {"source": p.source, "id": p.id, "new_tokens": len(o), "rounds": r}
            for p, o, r in zip(eval_prompts, ev.outputs, rounds)
        ],
    }
    assert compare_with_hf(report, hf)["equal"]


def test_the_engine_eval_leaves_out_of_both_phases_a_prompt_only_the_draft_server_refuses(
    serve_app, spec_server, tiny_target_dir, target, prompts
):
    """SGLang 0.5.23 reserves max(topk * steps, draft tokens) per request with a draft (tokenizer_manager.py
    `_validate_one_request`): a prompt that fits the server without the draft is refused by the one with it.
    The eval chooses its prompts with the reserve, so both phases decode the same prompts."""
    from models.eval.prompts import EvalPrompt
    from tasks.serving.eval_server import fit_draft_context

    model, tok = target
    near = [5] * (
        CONTEXT - MAX_NEW - 1
    )  # prompt + max_new_tokens = CONTEXT - 1: fits unless NUM_STEPS + 1 are reserved
    eval_prompts = [EvalPrompt("A", "near", near)] + [EvalPrompt("A", f"p{i}", p) for i, p in enumerate(prompts[:2])]
    params = {**GREEDY, "stop_token_ids": [tok.eos_token_id], "no_stop_trim": True}

    def decode(url, chosen, select=None):
        return engine_decode(url, chosen, params, model.config.vocab_size, select=select)

    unfiltered = decode(spec_server, eval_prompts)  # what the eval did before: the draft server refuses it
    assert list(unfiltered.refused) == ["near"] and "context length" in unfiltered.refused["near"]
    with_draft = decode(
        spec_server, eval_prompts, select=lambda limits, _: fit_draft_context(eval_prompts, limits, MAX_NEW)
    )
    assert list(with_draft.skipped) == ["near"] and with_draft.refused == {}
    assert sorted(s.id for s in with_draft.served) == ["p0", "p1"]
    with serve_app(create_app(tiny_target_dir, context_length=CONTEXT, max_batch_size=4, model_name="tiny")) as plain:
        assert [s.id for s in decode(plain, eval_prompts[:1]).served] == ["near"]  # the plain server takes it
