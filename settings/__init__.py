"""Every setting of a run, declared once: one module per config section (target.py, server.py, sampling.py,
generate.py, records.py, capture.py, train.py, eval.py, distributed.py, dataset.py), the launch keys capture and
train share (launch.py), `RunConfig` composing them (run.py), and what they need: the strict base (base.py), the run
directory's paths (layout.py), the stages (stages.py), the `hf:` path form (hub_paths.py). The page of every key is
generated from them (keys.py, `make config-keys`).

The lowest layer: the standard library and pydantic only (no torch, prefect, httpx, pyarrow or yaml), importable by
every layer above (models, tasks, flows, cli) and by the emulators (tests/test_layout.py)."""
