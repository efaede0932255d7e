"""The torch-free pieces every layer shares: job specs, the run directory's names, atomic writes, file errors,
the rank line protocol, findings. Nothing here imports torch, transformers or deepspeed (tests/test_layout.py)."""
