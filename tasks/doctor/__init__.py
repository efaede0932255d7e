"""The checks of `eagle3 doctor` and of the pipeline's preflight, one concern per module.

Each module returns findings (models/common/findings.py); flows/preflight.py runs them for a config and
prints the table. The environment's own checks are in models/ranks/environment.py (the GPU check runs
them without Prefect or httpx).
"""
