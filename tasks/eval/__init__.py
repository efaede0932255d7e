"""Stage 5, eval: the Prefect task that measures the exported draft's acceptance length (tasks.py). The
decoding itself is models/eval/job.py and models/eval/speculative_decoding.py."""
