"""The run config: its schema (schema.py: `RunConfig` and its sections), its file (file.py: read, checked, saved as
run, secrets kept out) and the page of every key generated from the schema (keys.py, `make config-keys`)."""
