"""`models.capture` where one rank finds the disk full at its first shard while the others are held.

Run like the real entry point, with CAPTURE_FAIL_RANK=R in the environment
(`torchrun ... tests/models/capture/capture_failing.py --job JOB.json`). Rank R's first shard write fails the
way safetensors reports a full disk ("... (os error 28)"). Every other rank, at its first shard,
waits for `<out_dir>/.release` (bounded by HOLD_S) before writing it, so it is certainly mid-run
when rank R exits: the test shows the launcher stops it at once rather than letting it work on.
"""

from __future__ import annotations

import os
import sys
import time

from safetensors import SafetensorError

from models.capture import job as capture
from models.capture import shards as hidden_shards

HOLD_S = 300.0
_flush = hidden_shards.ShardWriter.flush


def _full_disk(*args, **kwargs):
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _held_flush(self: hidden_shards.ShardWriter):
    if self._pending and not self.written:
        deadline = time.monotonic() + HOLD_S
        while not (self.out_dir / ".release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return _flush(self)


if os.environ.get("RANK") == os.environ["CAPTURE_FAIL_RANK"]:
    hidden_shards.save_file = _full_disk
else:
    hidden_shards.ShardWriter.flush = _held_flush

if __name__ == "__main__":
    sys.exit(capture.main())
