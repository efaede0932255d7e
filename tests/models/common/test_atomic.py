"""Atomic writes: a file appears whole (synced, renamed, its directory synced) or the old one stays."""

from __future__ import annotations

import os

import pytest

from models.common import atomic
from models.common.atomic import atomic_path, replace_dir, write_atomic


def test_write_replaces_whole_and_syncs_file_then_directory(tmp_path, monkeypatch):
    path = tmp_path / "latest"
    path.write_text("step-00000002")
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    assert write_atomic(path, "step-00000004") == path
    assert path.read_text() == "step-00000004"
    assert len(synced) == 2 and synced[0].startswith(str(tmp_path / ".latest.")) and synced[1] == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "index.parquet"
    path.write_bytes(b"old")
    with pytest.raises(OSError, match="disk full"):
        with atomic_path(path) as tmp:
            assert (
                tmp.parent == tmp_path
                and tmp.name.startswith(".index.parquet.")
                and tmp.name.endswith(atomic.TMP_SUFFIX)
            )
            tmp.write_bytes(b"half")
            raise OSError(28, "disk full")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.parquet"]


def test_replace_dir_publishes_the_new_directory_or_keeps_the_old(tmp_path, monkeypatch):
    dest = tmp_path / "final"
    dest.mkdir()
    (dest / "config.json").write_text("old")
    new = tmp_path / ".final.tmp-1"
    new.mkdir()
    (new / "config.json").write_text("new")
    real_rename = os.rename

    def second_rename_fails(a, b):  # dest -> .old works, new -> dest fails, .old -> dest restores
        if str(a) == str(new):
            raise OSError("rename failed")
        real_rename(a, b)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", second_rename_fails)
        with pytest.raises(OSError, match="rename failed"):
            replace_dir(new, dest)
    assert (dest / "config.json").read_text() == "old"
    replace_dir(new, dest)
    assert (dest / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # no .old left behind
