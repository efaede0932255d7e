"""Files that appear whole or not at all: a temp name beside the file, fsync, rename, fsync the directory.

A reader (or a resumed run) sees the old file or the complete new one, never a partial one: the bytes
go to `.<name>.<pid>-<random>.tmp` in the same directory (same filesystem, so the rename is atomic),
are fsynced, renamed over `<name>`, and the directory is fsynced so that the rename itself survives a
power cut. A failed write removes its temp file and re-raises the error as it came: callers turn it
into `WriteFailed` with what they kept (models/common/file_errors.py). A kill -9 can leave a temp file
behind; its name starts with '.' and ends with `TMP_SUFFIX`, so listings that skip dot-files ignore it.

Plain Python, no torch: the tasks use it too.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

TMP_SUFFIX = ".tmp"
# safetensors' save_file (0.8.0's Rust serialize_file, through the tempfile crate) writes `.tmpXXXXXX` beside the
# target and renames it into place: a kill -9 mid-write leaves one behind, in whatever directory it wrote to
_SAFETENSORS_TMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


def is_safetensors_temp(name: str) -> bool:
    """True for the name of a temp file safetensors' save_file leaves when killed mid-write."""
    return bool(_SAFETENSORS_TMP.match(name))


def temp_path(path: str | Path) -> Path:
    """A fresh hidden temp name beside `path`: unique per process and call, so writers never share one."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path for a writer that takes a file name; on success it becomes `path`, durably.

    For libraries that open the file themselves (safetensors `save_file`, `torch.save`). On an error
    the temp file is removed and the error re-raised; `path` is untouched.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO]:
    """Yield an open temp file ("wb" or "w"); on success it becomes `path`, durably (see `atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` (text as UTF-8) to `path` so that readers see the whole file or the old one; return `path`."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(path)


def fsync_file(path: str | Path) -> None:
    """Flush a file's bytes to the storage (a file someone else wrote and closed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | Path) -> None:
    """fsync every file below `directory` (before a rename publishes the directory, or a marker counts it)."""
    for p in Path(directory).rglob("*"):
        if p.is_file():
            fsync_file(p)


def fsync_dir(directory: str | Path) -> None:
    """Make the renames in `directory` durable.

    Filesystems that cannot sync a directory say EINVAL (or refuse to open it): there is nothing to
    make durable beyond what they already do, so that is not an error. A real I/O error is raised.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def replace_dir(tmp: str | Path, dest: str | Path) -> None:
    """Publish the finished directory `tmp` as `dest`: files fsynced, then renamed into place.

    An existing `dest` is moved aside first and removed once the new one is in place; if the rename
    fails it is moved back, so `dest` always holds a complete old or new directory.
    """
    tmp, dest = Path(tmp), Path(dest)
    fsync_tree(tmp)
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
