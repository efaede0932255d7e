"""Hub datasets (`path: hf:ORG/NAME`, tasks/datasets/hub.py), offline: a hand-made Hub cache in tmp_path is read like
the same rows in a local file, and the commit read is recorded so that a rerun reads it again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from settings.dataset import DatasetConfig, RowFormat
from settings.layout import RunLayout
from tasks.datasets import DatasetError, DatasetNotFoundError, HubDataset, iter_rows, load_dataset
from tasks.datasets.hub import dataset_source
from tests.hub_cache import offline_hub_cache, publish

COMMIT = "1" * 40
NEWER = "2" * 40
ROWS = [  # ShareGPT rows; the last repeats the first (a duplicate, dropped and counted)
    {"id": "a", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "2+2?"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Teal."}]},
]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    return offline_hub_cache(tmp_path, monkeypatch)


def _local(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "local.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_a_hub_dataset_reads_as_the_same_rows_in_a_local_file(hub_cache, tmp_path):
    record = tmp_path / "run" / "datasets" / "chats.json"
    with_answers = [r for r in ROWS if r["conversations"][-1]["from"] == "gpt"]
    for kind, rows, commit in (("generate", ROWS, COMMIT), ("passthrough", with_answers, NEWER)):
        publish(hub_cache, commit, [*rows, rows[0]])
        hub = load_dataset(HubDataset("org/chats", revision=commit, record=record), kind)
        local = load_dataset(_local(tmp_path, [*rows, rows[0]]), kind)
        assert [(r.id, r.messages) for r in hub.rows] == [(r.id, r.messages) for r in local.rows]
        assert [r.id for r in hub.rows] == [r["id"] for r in rows]
        assert hub.duplicates == local.duplicates == 1
        assert hub.path == Path("hf:org/chats")
        assert hub.shape == local.shape
    assert hub.rows[0].messages == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]


def test_the_commit_read_is_recorded_and_a_rerun_reads_it_after_main_moved(hub_cache, tmp_path):
    publish(hub_cache, COMMIT, ROWS)
    record = tmp_path / "run" / "datasets" / "chats.json"
    source = HubDataset("org/chats", record=record)
    first = load_dataset(source, "generate")
    assert json.loads(record.read_text()) == {"repo": "org/chats", "config": None, "split": "train", "revision": COMMIT}

    publish(hub_cache, NEWER, ROWS[:1])  # main moves on, with other rows
    again = load_dataset(source, "generate")
    assert again.rows == first.rows
    assert json.loads(record.read_text())["revision"] == COMMIT
    # a new run (no record) reads main, and records that
    fresh = tmp_path / "run2" / "datasets" / "chats.json"
    assert [r.id for r in load_dataset(HubDataset("org/chats", record=fresh), "generate").rows] == ["a"]
    assert json.loads(fresh.read_text())["revision"] == NEWER
    # a `revision` setting wins over the record, and is recorded
    pinned = load_dataset(HubDataset("org/chats", revision=NEWER, record=record), "generate")
    assert [r.id for r in pinned.rows] == ["a"]
    assert json.loads(record.read_text())["revision"] == NEWER


def test_a_recorded_commit_missing_from_the_offline_cache_is_a_clear_error(hub_cache, tmp_path):
    publish(hub_cache, COMMIT, ROWS)
    record = tmp_path / "datasets" / "chats.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"repo": "org/chats", "config": None, "split": "train", "revision": NEWER}))
    with pytest.raises(DatasetNotFoundError) as caught:
        load_dataset(HubDataset("org/chats", record=record), "generate")
    message = str(caught.value)
    assert f"revision {NEWER} (recorded in {record}" in message
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in message
    assert f"hf download --repo-type dataset org/chats --revision {NEWER}" in message
    assert f"delete {record}" in message
    # a record of another repo pins nothing
    record.write_text(json.dumps({"repo": "org/other", "config": None, "split": "train", "revision": NEWER}))
    assert len(load_dataset(HubDataset("org/chats", record=record), "generate").rows) == 3


def test_a_dataset_not_in_the_cache_says_how_to_download_it(hub_cache):
    with pytest.raises(DatasetNotFoundError, match="hf download --repo-type dataset org/absent"):
        load_dataset("hf:org/absent", "generate")


def test_split_and_row_format_settings_apply(hub_cache, tmp_path):
    publish(hub_cache, COMMIT, ROWS)
    publish(hub_cache, COMMIT, ROWS[2:], split="test")
    assert [r.id for r in load_dataset(HubDataset("org/chats", split="test"), "generate").rows] == ["c"]
    publish(hub_cache, COMMIT, [{"q": "What is 3+3?", "a": "6"}], repo="org/math")
    fmt = RowFormat(format="columns", prompt_field="q", response_field="a", id_field="q")
    rows = load_dataset(HubDataset("org/math"), "passthrough", row_format=fmt).rows
    assert [(r.id, r.messages) for r in rows] == [
        ("What is 3+3?", [{"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "6"}])
    ]
    with pytest.raises(DatasetError, match=f"hf:org/chats: at commit {COMMIT}: .*nope"):
        load_dataset(HubDataset("org/chats", split="nope"), "generate")
    # a bad row names the hf: path and the row
    publish(hub_cache, NEWER, [ROWS[0], {"id": "x", "conversations": [{"from": "human"}]}])
    with pytest.raises(DatasetError, match=r"^hf:org/chats row 2: .*conversations\[0\]\.value"):
        load_dataset(HubDataset("org/chats", revision=NEWER), "generate")


def test_a_bare_hf_path_reads_the_train_split_and_records_nothing(hub_cache, tmp_path):
    publish(hub_cache, COMMIT, ROWS)
    assert [number for number, _ in iter_rows("hf:org/chats", "generate")] == [1, 2, 3]
    with pytest.raises(DatasetError, match="hf:org is not a Hub dataset path|'hf:org' is not a Hub dataset path"):
        load_dataset("hf:org", "generate")


def test_without_the_datasets_library_the_error_says_to_install_it(hub_cache, monkeypatch):
    publish(hub_cache, COMMIT, ROWS)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(DatasetError, match="pip install datasets"):
        load_dataset("hf:org/chats", "generate")


# --- the config: the hf: form, its settings, the record's place ---------------------------------------------


def test_the_config_keeps_hf_paths_and_hands_the_loader_a_hub_dataset(tmp_path):
    dataset = DatasetConfig(name="chats", kind="generate", path="hf:org/chats", split="test", config="en")
    layout = RunLayout(tmp_path / "run")
    assert dataset_source(dataset, layout) == HubDataset(
        "org/chats", split="test", config="en", record=tmp_path / "run" / "datasets" / "chats.json"
    )
    local = DatasetConfig(name="local", kind="generate", path="prompts.jsonl")
    assert dataset_source(local, layout) == Path("prompts.jsonl")
    assert dataset_source(DatasetConfig(name="x", kind="generate", path="hf:org/chats"), layout).split == "train"


@pytest.mark.parametrize("path", ["hf:", "hf:chats", "hf:org/chats/extra", "hf:org//chats", "hf:org/chats@main"])
def test_a_bad_hf_path_is_a_config_error_that_shows_the_form(path):
    with pytest.raises(ValidationError, match="is not a Hub dataset path: expected hf:ORG/NAME"):
        DatasetConfig(name="chats", kind="generate", path=path)


def test_hub_settings_on_a_local_path_are_a_config_error():
    with pytest.raises(ValidationError, match="split, revision apply to Hub datasets only"):
        DatasetConfig(name="chats", kind="generate", path="prompts.jsonl", split="train", revision="main")


def test_the_config_setting_picks_a_config_the_readme_declares(hub_cache):
    publish(hub_cache, COMMIT, ROWS[:1])
    snapshot = hub_cache / "datasets--org--chats" / "snapshots" / COMMIT
    (snapshot / "fr").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[1:]), snapshot / "fr" / "train-00000-of-00001.parquet")
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: en\n  data_files:\n  - split: train\n    path: data/*.parquet\n  default: true\n"
        "- config_name: fr\n  data_files:\n  - split: train\n    path: fr/*.parquet\n---\n"
    )
    assert [r.id for r in load_dataset(HubDataset("org/chats"), "generate").rows] == ["a"]
    assert [r.id for r in load_dataset(HubDataset("org/chats", config="fr"), "generate").rows] == ["b", "c"]
    with pytest.raises(DatasetError, match="set the dataset's split / config to one it has"):
        load_dataset(HubDataset("org/chats", config="de"), "generate")


def test_a_config_file_keeps_the_hf_path_and_names_the_dataset_of_a_bad_one(tmp_path):
    from flows.config.file import ConfigError, parse_config

    data = {
        "run_dir": "runs/x",
        "target": {"path": "models/t"},
        "datasets": [
            {"name": "local", "kind": "generate", "path": "b.jsonl"},
            {"name": "chats", "kind": "generate", "path": "hf:org/chats", "split": "test"},
        ],
    }
    config = parse_config(data, base=tmp_path)
    assert config.datasets[0].path == tmp_path / "b.jsonl"
    assert config.datasets[1].path == Path("hf:org/chats")  # not resolved against the config's directory
    assert dataset_source(config.datasets[1], config.layout).record == tmp_path / "runs/x/datasets/chats.json"
    data["datasets"][1]["path"] = "hf:org/chats:test"
    with pytest.raises(ConfigError) as caught:
        parse_config(data, base=tmp_path)
    (line,) = caught.value.problems
    assert line.startswith("datasets[1].path:")
    assert "expected hf:ORG/NAME" in line and "`split:`" in line
