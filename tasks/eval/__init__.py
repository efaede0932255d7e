"""Stage 5, eval: the Prefect task that measures the exported draft's acceptance length (tasks.py). The
decoding itself is models/eval_job.py and models/speculative_decoding.py."""
