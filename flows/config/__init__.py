"""The run config as a file (file.py): YAML read and checked with every problem named, saved as run, secrets kept out.
The schema itself is settings/ (settings/run.py `RunConfig`)."""
