"""The bottom layer: torch code (draft model, vocab mapping, capture and training rank entry points,
evaluation, tiny target) and the torch-free pieces every layer shares (job specs in jobs.py, file
errors, atomic writes, the rank line protocol). Modules that do torch math import models.numerics."""
