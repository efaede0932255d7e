"""Where the test session's tiny targets are built, once, for every xdist worker; and a command that builds them first.

Each target is byte-for-byte reproducible from its build parameters (models/target/tiny.py), and `build_*_target`
reuses a directory whose build info equals them, so a build made before the tests is the one the tests would make.
`kimi-int4` is the kimi target published INT4 (models/target/int4.py), quantized from the `kimi` one (seconds).
By default they are built in the session's common temp dir. With `EAGLE3_TEST_TARGETS=DIR` they are built (or
reused) in DIR: `.ci/run` builds them there with `python -m tests.targets DIR tiny` and `... kimi` while the engines
install (that install leaves CPU idle). Builders take a lock per target, so a test that asks for one while the
command is still building it waits for that build, and the tests need not wait for the command to end.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Callable
from pathlib import Path

ENV = "EAGLE3_TEST_TARGETS"
TARGETS = ("tiny", "kimi", "kimi-int4")


def shared_root(basetemp: Path) -> Path:
    """`$EAGLE3_TEST_TARGETS`, else the session's common temp dir (pytest-N/, above the workers' popen-gwK/)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).resolve()
    return basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp


def built(root: Path, name: str) -> Path:
    """The target `name` (one of TARGETS) under `root`, built under its lock unless its build is already there."""
    # Imported here so test sessions that never ask for a model do not pay for torch/transformers.
    from models.target.tiny import build_int4_target, build_kimi_target, build_tiny_target

    builders: dict[str, Callable[[Path], Path]] = {
        "tiny": build_tiny_target,
        "kimi": build_kimi_target,
        "kimi-int4": lambda out: build_int4_target(out, base_dir=built(root, "kimi")),
    }
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}_target.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return builders[name](root / f"{name}_target" / "model")


def main(argv: list[str]) -> int:
    names = argv[1:] or list(TARGETS)
    if not argv or any(name not in TARGETS for name in names):
        print(
            f"usage: python -m tests.targets DIR [{'|'.join(TARGETS)} ...]  (then run the tests with {ENV}=DIR)",
            file=sys.stderr,
        )
        return 2
    for name in names:
        print(f"tests.targets: {name}: {built(Path(argv[0]).resolve(), name)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
