"""SGLang's native HTTP protocol, as the dev server and the simulated server speak it.

One definition of the subset of SGLang's API the pipeline uses, for ``emulators/dev_server/`` (a
real model) and ``emulators/sim/`` (a simulation); each server supplies only what differs
through `SGLangBackend`, and `create_sglang_app` gives both the same endpoints and rules (app.py).

Which SGLang: every rule here follows SGLang 0.5.23 (read in its wheel; files are named relative
to the ``sglang`` package). A server started with ``sglang_version="0.4"`` follows SGLang 0.4.x
(read in 0.4.10.post2) where the two differ -- `SGLangVersion` lists each difference with its source.
tests/emulators/test_sglang_contract.py checks every rule against both servers.

One concept per file, each citing the SGLang source it follows:

- versions.py: `SGLangVersion`, the SGLang a server follows (0.5.23, or 0.4.x where they differ).
- errors.py: SGLang's error bodies (three 400 shapes, 500/503) and the exceptions that produce them.
- contract.py: the 0.5 /generate contract gate (api/v1/api_types.py ``decode_GenerateRequest``), `contract_error`.
- sampling.py: `SamplingParams` with SGLang's defaults and checks, `parse_sampling_params`.
- limits.py: `ModelLimits`, the context and length checks of one prompt; `num_reserved_tokens` of an EAGLE draft.
- request.py: the /generate and /abort_request bodies (`parse_generate`, `parse_abort`).
- rids.py: the rids a server holds (`HeldRids`), which requests an abort reaches (`abort_matcher`).
- results.py: finish reasons and the answers to finished and aborted requests (`generate_result`, ...).
- info.py: the /server_info, /v1/loads and /model_info bodies, once for both servers.
- auth.py: ``--api-key`` / ``--admin-api-key`` (`Auth`) and the middleware that applies them.
- disconnect.py: a disconnected client noticed on SGLang's 4 s poll (`results_or_abort`).
- flags.py: the SGLang flags both servers' CLIs take (`add_server_flags`).
- app.py: `SGLangBackend` and `create_sglang_app`, the routes over it.

Import each name from the file that defines it.
"""
