"""Stage 1, generate: the Prefect tasks (tasks.py), the send-and-checkpoint loop against SGLang (loop.py), the
token budget, prompt rendering, passthrough copies, and `eagle3 import-jsonl` (legacy_import.py)."""
