"""Stage 4, train: the Prefect task that runs the DeepSpeed training job (tasks.py) and the training report
with its plot (report.py). The ranks themselves are models/train/job.py."""
