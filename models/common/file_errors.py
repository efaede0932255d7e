"""What to tell the user when a file of the run cannot be written, or cannot be read back.

Every stage stops at the first failed write: going on would generate, capture or train work that
can no longer be kept. `WriteFailed` carries one message that names the path, what the OS said in
plain words with the free space of that filesystem, what is kept, and how to resume.
`DamagedFile` names a file that is there but cannot be read (a truncated part, a shard cut by a
disk fault), what is wrong and what to do. Both live in models/ (the bottom layer, torch-free)
because the rank processes raise them and the tasks read them back from the ranks' reports.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# errno -> what a user would call it; anything else falls back to os.strerror.
_MEANINGS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "I/O error (failing disk or lost network mount?)",
    errno.EMFILE: "too many open files",
    errno.ENAMETOOLONG: "file name too long",
    errno.ENOENT: "directory vanished",
    errno.EFBIG: "file too large for this file system",
}


class WriteFailed(Exception):
    """A write under the run directory failed; the stage stopped at once and kept what was durable."""

    def __init__(self, path: Path | str, error: BaseException, *, kept: str = "", resume: str = ""):
        self.path = Path(path)
        self.errno = getattr(error, "errno", None)
        self.error = error
        self.kept = kept
        self.resume = resume
        parts = [f"cannot write {self.path}: {os_error_meaning(self.path, error)}"]
        if kept:
            parts.append(f"kept: {kept}")
        if resume:
            parts.append(f"to resume: {resume}")
        super().__init__(". ".join(parts))

    def __reduce__(self):  # Prefect pickles task exceptions into results
        return (_rebuild, (str(self.path), self.errno, str(self.error), self.kept, self.resume))


class DamagedFile(ValueError):
    """A file of the run cannot be read: names it, what is wrong and what to do."""

    def __init__(self, path: str | Path, problem: str, advice: str = ""):
        self.path, self.problem, self.advice = Path(path), problem, advice
        super().__init__(f"{self.path} is damaged ({problem})" + (f". {advice}" if advice else ""))

    def __reduce__(self):  # Prefect pickles task exceptions into results
        return (type(self), (str(self.path), self.problem, self.advice))

    def with_advice(self, advice: str) -> DamagedFile:
        """The same damage, with what to do in the reader's terms."""
        return type(self)(self.path, self.problem, advice)


SHARD_ADVICE = "Delete it and run the capture stage again: its samples are captured again, every other shard is kept"


class DamagedShard(DamagedFile):
    """A hidden-state shard that cannot be read (a complete shard is never partial: this is damage)."""

    def __init__(self, path: str | Path, problem: str, advice: str = SHARD_ADVICE):
        super().__init__(path, problem, advice)


def _rebuild(path: str, code: int | None, text: str, kept: str, resume: str) -> WriteFailed:
    return WriteFailed(path, OSError(code, text) if code is not None else OSError(text), kept=kept, resume=resume)


def os_error_meaning(path: Path | str, error: BaseException) -> str:
    """`disk full: 0 bytes free on /data` — the errno in words, with the free space where it applies."""
    code = getattr(error, "errno", None)
    meaning = _MEANINGS.get(code) if code is not None else None
    if meaning is None:
        meaning = os.strerror(code) if code else f"{type(error).__name__}: {error}"
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        where = mount_point(path)
        free = free_bytes(where)
        if free is not None:
            meaning += f": {free:,} bytes free on {where}"
        if code == errno.ENOSPC and free_inodes(where) == 0:
            meaning += " and no free inodes (too many files)"
    return meaning


def mount_point(path: Path | str) -> Path:
    """The mount point of the filesystem that holds `path` (or would hold it)."""
    p = existing_parent(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def existing_parent(path: Path | str) -> Path:
    """`path` itself or its nearest ancestor that exists."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path | str) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem of `path`; None if it cannot be read."""
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def free_inodes(path: Path | str) -> int | None:
    """Free inodes on the filesystem of `path` (None where the filesystem does not count them)."""
    try:
        st = os.statvfs(existing_parent(path))
    except OSError:
        return None
    return st.f_favail if st.f_files else None


def is_write_error(error: BaseException) -> bool:
    """An OSError that means the storage refused the write (not a missing input or a bug)."""
    return isinstance(error, OSError) and getattr(error, "errno", None) in _MEANINGS
