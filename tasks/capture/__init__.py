"""Stage 3, capture: the Prefect tasks that plan the disk and run the DeepSpeed capture job (tasks.py), and the
disk planner behind `eagle3 plan` (plan.py). The ranks themselves are models/capture/job.py."""
