import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.responses.parquet_io import (
    clean_stale_temps,
    list_parts,
    next_part_path,
    read_metadata,
    write_parquet_atomic,
)


def _table(n: int = 3) -> pa.Table:
    return pa.table({"id": [f"r{i}" for i in range(n)], "x": list(range(n))})


def test_write_round_trip_with_metadata(tmp_path):
    table = _table().replace_schema_metadata({"kept": "yes"})
    path = write_parquet_atomic(table, tmp_path / "out" / "part-000000.parquet", {"rows": 3, "dataset": "B1"})

    assert path == tmp_path / "out" / "part-000000.parquet"
    assert pq.read_table(path).to_pylist() == table.to_pylist()
    assert read_metadata(path) == {"kept": "yes", "rows": "3", "dataset": "B1"}
    assert os.listdir(tmp_path / "out") == ["part-000000.parquet"]  # no temp left behind


def test_write_fsyncs_file_and_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    write_parquet_atomic(_table(), tmp_path / "part-000000.parquet")
    assert len(synced) == 2


def test_part_numbering_continues_and_never_reuses(tmp_path):
    assert list_parts(tmp_path / "missing") == []
    assert next_part_path(tmp_path / "missing") == tmp_path / "missing" / "part-000000.parquet"

    for _ in range(2):
        write_parquet_atomic(_table(), next_part_path(tmp_path))
    write_parquet_atomic(_table(), tmp_path / "part-000010.parquet")  # a gap
    assert next_part_path(tmp_path) == tmp_path / "part-000011.parquet"
    assert next_part_path(tmp_path, prefix="shard") == tmp_path / "shard-000000.parquet"
    assert [p.name for p in list_parts(tmp_path)] == [
        "part-000000.parquet",
        "part-000001.parquet",
        "part-000010.parquet",
    ]


def test_list_parts_ignores_temp_and_foreign_files(tmp_path):
    write_parquet_atomic(_table(), tmp_path / "part-000001.parquet")
    write_parquet_atomic(_table(), tmp_path / "part-000000.parquet")
    for name in [".part-000002.parquet.123-abcd.tmp", "part-000003.parquet.tmp", "other.parquet", "part-x.parquet"]:
        (tmp_path / name).write_bytes(b"partial")

    assert [p.name for p in list_parts(tmp_path)] == ["part-000000.parquet", "part-000001.parquet"]
    assert next_part_path(tmp_path).name == "part-000002.parquet"


def test_crash_before_rename_leaves_previous_parts_untouched(tmp_path, monkeypatch):
    first = write_parquet_atomic(_table(2), next_part_path(tmp_path), {"n": 1})
    before = first.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        write_parquet_atomic(_table(5), next_part_path(tmp_path))
    monkeypatch.undo()

    assert list_parts(tmp_path) == [first]
    assert first.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["part-000000.parquet"]
    # The next write takes the next number as if the crash never happened.
    assert write_parquet_atomic(_table(), next_part_path(tmp_path)).name == "part-000001.parquet"


def test_kill_leftover_temp_is_invisible_and_cleaned(tmp_path):
    part = write_parquet_atomic(_table(), next_part_path(tmp_path))
    stale = tmp_path / ".part-000001.parquet.999-deadbeef.tmp"
    stale.write_bytes(b"PAR1 half a file")

    assert list_parts(tmp_path) == [part]
    assert clean_stale_temps(tmp_path, older_than_s=3600) == []  # too fresh: a live writer's
    assert clean_stale_temps(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == ["part-000000.parquet"]
    assert clean_stale_temps(tmp_path / "missing") == []
