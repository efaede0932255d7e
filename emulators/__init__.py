"""Emulations of the serving engines, for the demo and the tests: each follows a named engine version and cites it.

- sglang_protocol/: SGLang's native HTTP API on the server side (SGLang 0.5.23, or 0.4.x), once for both servers;
  one concept per file.
- dev_server/: that API over a real tiny Hugging Face model on CPU (the demo's engine, ``server.launch: dev``);
  one concept per file.
- vllm_extract.py: vLLM's hidden-state extraction endpoint, mounted by the dev server.
- sim/: a simulated SGLang server with no model (fake outputs, a capacity model, fault injection).
"""
