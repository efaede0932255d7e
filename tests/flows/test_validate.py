"""flows/validate.py: `eagle3 validate` prints each dataset's row format, detected or configured."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from flows.config_file import parse_config
from flows.validate import validate_datasets

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "formats"  # not data/samples: the tiny target trains on those


def test_validate_prints_the_format_of_every_dataset(tmp_path):
    (tmp_path / "junk.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    config = parse_config(
        {
            "run_dir": str(tmp_path / "run"),
            "target": {"path": str(tmp_path / "t")},
            "datasets": [
                {"name": "B3_code", "kind": "generate", "path": str(SAMPLES / "fmt_columns.jsonl")},
                {
                    "name": "B6_sharegpt",
                    "kind": "generate",
                    "path": str(SAMPLES / "fmt_sharegpt.jsonl"),
                    "format": "sharegpt",
                },
                {"name": "A1_alpaca", "kind": "passthrough", "path": str(SAMPLES / "fmt_alpaca.jsonl")},
                {
                    "name": "B5_ultrachat",
                    "kind": "generate",
                    "path": str(SAMPLES / "fmt_ultrachat.jsonl"),
                    "id_field": "id",
                },
                {"name": "B2_chat", "kind": "generate", "path": str(SAMPLES / "fmt_columns_as_messages.jsonl")},
                {"name": "B9_junk", "kind": "generate", "path": str(tmp_path / "junk.jsonl"), "on_bad_row": "skip"},
            ],
        },
        base=tmp_path,
    )
    console = Console(record=True, width=250, color_system=None)
    assert not validate_datasets(config, config_path=tmp_path / "c.yaml", console=console)  # B9_junk has no usable row
    out = console.export_text()
    assert "B3_code: format columns (auto: problem -> user, solution -> assistant)\n" in out
    assert "B6_sharegpt: format sharegpt (configured: conversations: from -> role, value -> content)\n" in out
    assert "A1_alpaca: format alpaca (auto: instruction + input -> user, output -> assistant)\n" in out
    assert "B5_ultrachat: format ultrachat (auto: data: user, assistant, ... alternating)\n" in out
    assert "B2_chat: format messages (auto)\n" in out
    assert "B9_junk: format auto, not detected from any row\n" in out
    # the bad row's line in the list of problems holds the config line that reads it
    assert (
        "junk.jsonl line 1: has keys [question, answer], which fit no row format; set format: columns, "
        "prompt_field: question, response_field: answer in the dataset's config\n"
    ) in out
