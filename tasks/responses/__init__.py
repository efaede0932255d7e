"""The responses store: what generate writes and records, stats and the doctor read. Atomic Parquet parts
(parquet_io.py), the checkpoints of generated and passthrough responses (checkpoints.py), rejects with their causes
(rejects.py), turn ids of a conversation (turn_ids.py), counts that add up part by part (tallies.py) and the stats
from Parquet footers (stats.py)."""
