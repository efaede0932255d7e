"""The `eagle3` commands that are not stage flows: the CLI itself (cli.py) and what its commands print or write
beside the flows: the demo (demo.py), the preflight (doctor.py), the plan (plan.py), the datasets table (validate.py),
a draft in another format (export.py) and the DeepSpeed config copies (deepspeed_json.py)."""
