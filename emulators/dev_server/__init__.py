"""SGLang-compatible dev server: SGLang's native HTTP protocol over a small HF causal LM on CPU.

Used by the embedded demo and the tests in place of a real SGLang server. It speaks the subset of
SGLang's native API the pipeline uses -- endpoints, request rules, response and error shapes are
defined once in ``emulators/sglang_protocol/`` (shared with the simulated server); this package is
the real model behind them:

- ``POST /generate`` takes ``text`` (tokenized with no chat template and no special tokens) or
  ``input_ids``. SGLang sampling params it does not implement (stop strings, penalties,
  grammars, ...) are refused (400) unless they have their no-op values.
- ``GET /health_generate`` is a 1-token probe through the batcher.

SGLang behaviours it follows (SGLang 0.5.23 unless started with ``sglang_version="0.4"``; the rules
and their sources are in ``emulators/sglang_protocol/``): a stop token before the length cap
(`Batcher._append`, `Batcher._speculate`); a held rid refused as a duplicate; a disconnected client
noticed only on the ``disconnect_poll_s`` poll (default SGLang's 4 s); /abort_request by rid prefix;
the queued-abort and running-abort answers; ``--api-key`` / ``--admin-api-key``; /flush_cache
refused (400) while requests are in flight, and resetting the speculative metrics when it succeeds.

Deliberate differences from SGLang: ``cached_tokens`` is always 0 (no prefix cache).
``max_new_tokens: 0`` returns at once with no tokens and finish ``length`` 0, without running
the model. A request aborted after it left the queue but before its prefill ran finishes as a
running abort with no tokens (SGLang runs that one prefill first).

One concept per file:

- speculative.py: `Speculative`, a draft to serve with, from SGLang's ``--speculative-*`` flags (greedy chain
  speculative decoding, ``spec_verify_ct``, the reserved tokens).
- sequence.py: `BatchSequence`, one request inside the batcher, and its KV cache.
- batcher.py: `Batcher`, the continuous batcher: one worker thread owns the model; SGLang's speculative metrics
  (``avg_spec_accept_length``).
- sampling.py: `sample`, one token from the logits (greedy, or temperature + top-k + top-p).
- draft.py: `load_served_draft`, an EAGLE-3 export as SGLang serves it.
- backend.py: `DevBackend`, the model behind sglang_protocol's endpoints.
- app.py: `create_app` (the model, the batcher and sglang_protocol's app; vLLM's hidden-state extraction) and
  `serve`, uvicorn until interrupted.
- cli.py: `main`, the command line (also ``eagle3 serve-dev``).
- __main__.py: ``python -m emulators.dev_server --model DIR [--host] [--port] [--speculative-* ..]
  [--api-key ..] [--sglang-version 0.5|0.4] ...``.
"""
