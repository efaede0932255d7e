"""What every command and stage shares to run at all: the run lock (run_lock.py) and the dead runs it finds
(dead_runs.py), Prefect's API and artifacts (prefect_api.py, artifacts.py), stopping on a signal (stopping.py),
rank launches (launch_ranks.py, torch_extensions.py), free ports (ports.py), heartbeats (heartbeat.py) and blocking
work in threads (threads.py)."""
