"""The eval stage's process: the draft's acceptance on prompts and benchmarks (`python -m models.eval`)."""
