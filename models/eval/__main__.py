"""`python -m models.eval --job JOB.json`: the entry point of models/eval/job.py."""

import sys

from models.eval.job import main

sys.exit(main())
