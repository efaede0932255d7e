"""Simulated SGLang server: SGLang's native HTTP protocol with deterministic fake outputs, no model.

For the generate-stage tests (fault injection, kill/resume determinism) and for the generate
benchmark (a server of known capacity). It speaks the same subset of SGLang's native API as
``emulators/dev_server/``, with the same request, response and error shapes (see that package's
docstring), and adds fault injection.

Endpoints: SGLang's, from ``emulators/sglang_protocol/app.py`` (``text`` is refused: no tokenizer;
sampling params SGLang knows but the simulation does not model are accepted and ignored), with
its rules (SGLang 0.5.23, or 0.4.x with ``sglang_version="0.4"``): a held rid refused as a
duplicate, a disconnected client noticed only on the ``disconnect_poll_s`` poll (SGLang's 4 s;
meanwhile the request runs and holds its rid), /abort_request by rid prefix, the queued- and
running-abort answers, ``api_key`` / ``admin_api_key``, the contract gate's 400s, and
``reserved_tokens`` (what an EAGLE server reserves per request in its length checks). Admin:
``POST /_fault`` (see ``SimServer.apply_fault``) and ``GET /_stats`` for a server in another
process; they take no key.

One concept per file:

- config.py: `SimConfig`, what the simulated model and server look like.
- output.py: the simulated model, `simulate_output`: a pure function of the prompt and the sampling params.
- scheduler.py: the continuous-batching capacity model and SGLang's abort rules (the engine half of `SimServer`).
- backend.py: the engine behind sglang_protocol's endpoints (`SimBackend`).
- faults.py: the fault API (`SimServer.fail_next`, ``drop_next``, ``down``, ..., ``apply_fault``) and its middleware.
- connections.py: the open TCP connections that the faults cut.
- stats.py: the counters, `SimStats`.
- server.py: `SimServer` and its lifecycle, uvicorn in a background thread or in the foreground.
- __main__.py: the CLI, ``python -m emulators.sim --port N [--max-running ..] [--decode-ms ..] [--mean-len ..]
  [--seed ..] [--model-path ..] [--api-key ..] [--admin-api-key ..] [--sglang-version 0.5|0.4] [--disconnect-poll-s ..]
  [--reserved-tokens ..] [--length-rules FILE.json]``.

Run it in-process: ``with SimServer(max_running=4) as srv: srv.url``.
"""

from emulators.sim.config import SimConfig
from emulators.sim.output import SimOutput, simulate_output
from emulators.sim.server import SimServer
from emulators.sim.stats import SimStats

__all__ = ["SimConfig", "SimOutput", "SimServer", "SimStats", "simulate_output"]
