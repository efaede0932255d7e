"""`python -m models.capture --job JOB.json`: the entry point of models/capture/job.py."""

import sys

from models.capture.job import main

sys.exit(main())
