"""`python -m models.train --job JOB.json`: the entry point of models/train/job.py."""

import sys

from models.train.job import main

sys.exit(main())
