"""The torch-free pieces the layers share above settings/: the in-process jobs (jobs.py) and the job files a launched
process reads (job_files.py), atomic writes, file errors, the rank line protocol, findings. Nothing here imports torch,
transformers or deepspeed (tests/test_layout.py)."""
