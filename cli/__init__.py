"""The `eagle3` command line (app.py), above the flows: each command parses its config once, takes the run lock once
(flows/stage_run.py `held_run`), and prints what the flows return. What a command prints or writes beside the flows:
the demo (demo.py), the checks table (doctor.py), the plan (plan.py), the datasets table (validate.py), a draft in
another format (export.py) and the DeepSpeed config copies (deepspeed_json.py)."""

import flows  # noqa: F401  (Prefect's environment defaults, set before any Prefect import)
