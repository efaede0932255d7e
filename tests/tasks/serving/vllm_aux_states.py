"""Run in .venv-vllm (not by pytest): the aux hidden states a REAL vLLM selects for EAGLE-3, through its offline API.

    python vllm_aux_states.py REQUEST.json OUT.safetensors

REQUEST.json: {"target": DIR, "layer_ids": [vLLM ids], "prompts": [[token ids], ...], "max_model_len": N,
"limit_mm_per_prompt": {...} or null}. OUT holds `p{i}.id{k}` [n_i, H] float32 for prompt i and vLLM id k.

How: the target's DeepSeek/Llama text model in vLLM keeps, for each id in `aux_hidden_state_layers`, the
hidden state entering layer id (`hidden_states + residual`), and for id == L the end layer's output before
the final norm (vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward, 0.32.0): exactly what
the EAGLE-3 proposer receives. The ids are set with the model's own `set_aux_hidden_state_layers` (what
vLLM's EAGLE-3 setup calls); a forward hook on the text model keeps the aux list and hands the runner the
plain hidden states, as it expects without a draft. One prompt per generate call (max_tokens 1: the prefill
forward only), prefix caching off, so each forward sees one whole prompt.
"""

from __future__ import annotations

import json
import os
import sys

# apply_model sends its function to the engine core process (cloudpickle): vLLM refuses that unless allowed
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


# The engine's worker runs these functions in its own process: they are pickled by reference, so they live at the
# top of a module the worker can import (this file's folder is put on its path, below).


def text_model(model):
    """vLLM's causal LM inside a multimodal wrapper (KimiK25ForConditionalGeneration.language_model), or itself."""
    return getattr(model, "language_model", model)


def install(ids, model):
    """Select the aux ids and keep what the text model returns for them; the runner gets the plain hidden states."""
    import torch

    lm = text_model(model)
    lm.set_aux_hidden_state_layers(tuple(ids))
    lm._aux_store = []

    def hook(module, args, out):
        if isinstance(out, tuple):
            hidden, aux = out
            module._aux_store.append([a.detach().to(torch.float32).cpu().clone() for a in aux])
            return hidden
        return out

    # On the causal LM, not its inner model: vLLM's compile decorator calls the inner model's forward directly,
    # past any hook (vllm/compilation/decorators.py), while the wrapper and the runner call the causal LM as a module.
    lm.register_forward_hook(hook)
    return type(lm).__name__


def clear(model):
    text_model(model)._aux_store.clear()


def first_forward(model):
    return text_model(model)._aux_store[0]


def main(request_path: str, out_path: str) -> int:
    import functools

    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    import vllm_aux_states as me  # by this name, so the worker unpickles the functions from it

    request = json.loads(open(request_path).read())
    ids = [int(k) for k in request["layer_ids"]]
    extra = {"limit_mm_per_prompt": request["limit_mm_per_prompt"]} if request.get("limit_mm_per_prompt") else {}
    llm = LLM(
        model=request["target"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=int(request["max_model_len"]),
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        seed=0,
        **extra,
    )
    print("vllm text model:", llm.apply_model(functools.partial(me.install, ids)), flush=True)
    tensors = {}
    for i, prompt in enumerate(request["prompts"]):
        llm.apply_model(me.clear)
        llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], SamplingParams(max_tokens=1, temperature=0.0))
        stored = llm.apply_model(me.first_forward)[0]
        if len(stored) != len(ids):
            raise RuntimeError(f"prompt {i}: vLLM kept {len(stored)} aux states for ids {ids}")
        for k, state in zip(ids, stored):
            if state.shape[0] != len(prompt):
                raise RuntimeError(f"prompt {i}: id {k}: {state.shape[0]} positions for a {len(prompt)}-token prompt")
            tensors[f"p{i}.id{k}"] = state.contiguous()
    save_file(tensors, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
