"""`models.capture` whose ranks stop after writing their first shard, for the kill-and-resume test.

Run like the real entry point (`torchrun ... tests/models/capture/capture_held.py --job JOB.json`). After a
rank writes its first shard it waits for `<out_dir>/.release` (bounded): the test sees the shard,
SIGKILLs the launch while it is certainly mid-run, and never releases it.
"""

from __future__ import annotations

import sys
import time

from models.capture import job as capture
from models.capture import shards as hidden_shards

HOLD_S = 120.0
_flush = hidden_shards.ShardWriter.flush


def _held_flush(self: hidden_shards.ShardWriter):
    path = _flush(self)
    if path is not None and len(self.written) == 1:
        deadline = time.monotonic() + HOLD_S
        while not (self.out_dir / ".release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return path


def hold_after_first_shard() -> None:
    """Every ShardWriter from now on waits (bounded) after its first shard (the vLLM backend's test uses it too)."""
    hidden_shards.ShardWriter.flush = _held_flush


hold_after_first_shard()

if __name__ == "__main__":
    sys.exit(capture.main())
