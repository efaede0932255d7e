"""Stage 2, records: the Prefect tasks (tasks.py), responses and passthrough rows into training records
(build.py), and loss masks of finished conversations through the chat template (chat_masks.py)."""
