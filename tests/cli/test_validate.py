"""cli/validate.py: `eagle3 validate` prints each dataset's row format, detected or configured."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from cli.validate import validate_datasets
from flows.config.file import parse_config
from tasks.datasets import load_dataset
from tasks.datasets.hub import dataset_source

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


KIMI = Path(__file__).resolve().parents[2] / "configs" / "kimi-k25.yaml"
KIMI_FORMATS = {  # the line `eagle3 validate configs/kimi-k25.yaml` prints per dataset, and the rows of its sample
    "A1_deepswekimi": ("messages (configured)", 3),
    "A2_kimik25": ("messages (configured)", 3),
    "B1_glaive": (
        "glaive (configured: system -> system, chat: USER: -> user, ASSISTANT: -> assistant, FUNCTION RESPONSE: -> "
        "tool)",
        4,
    ),
    "B2_opencodeinstruct": ("columns (configured: input -> user, output -> assistant)", 3),
    "B3_magicoder": ("columns (configured: problem -> user, solution -> assistant)", 3),
    "B4_mixturethoughts": ("messages (configured)", 3),
    "B5_ultrachat": ("messages (configured: id: prompt_id)", 3),
    "B6_sharegpt": ("sharegpt (configured: conversations: from -> role, value -> content)", 3),
    "B7_openmathinstruct": ("columns (configured: problem -> user, generated_solution -> assistant)", 3),
    "B8_toolcalls": ("messages (configured)", 3),
}


def _kimi_on_samples(tmp_path, *, auto: bool = False):
    """configs/kimi-k25.yaml, each dataset's path at data/formats/kimi/<its file name> (`auto`: no format lines)."""
    import yaml

    data = yaml.safe_load(KIMI.read_text())
    data["run_dir"] = str(tmp_path / "run")
    for dataset in data["datasets"]:
        dataset["path"] = str(SAMPLES / "kimi" / Path(dataset["path"]).name)
        if auto:
            for key in ("format", "prompt_field", "response_field", "system_field"):
                dataset.pop(key, None)
    return parse_config(data, base=tmp_path)


def test_validate_reads_the_kimi_config_on_samples_of_each_real_format(tmp_path):
    config = _kimi_on_samples(tmp_path)
    assert [d.name for d in config.datasets] == list(KIMI_FORMATS)
    console = Console(record=True, width=250, color_system=None)
    assert validate_datasets(config, config_path=KIMI, console=console)
    out = console.export_text()
    for name, (described, _) in KIMI_FORMATS.items():
        turns = "; turns: all, 5 user turns to answer (up to each conversation's first tool call)"
        assert f"\n{name}: format {described}{turns if name == 'B5_ultrachat' else ''}\n" in out
    assert f"{KIMI} is valid: 10 dataset(s) ready." in out
    for dataset in config.datasets:  # every row of every sample loads
        loaded = load_dataset(dataset_source(dataset, config.layout), dataset.kind, row_format=dataset.row_format)
        assert len(loaded.rows) == KIMI_FORMATS[dataset.name][1] and not loaded.rejects and not loaded.duplicates
    b5 = next(d for d in config.datasets if d.name == "B5_ultrachat")
    assert [r.id[:8] for r in load_dataset(b5.path, "generate", row_format=b5.row_format).rows] == [
        "4e1b7c0d",
        "a7c9e1b3",
        "0d9a2f6e",
    ]


def test_auto_reads_the_kimi_samples_as_the_config_says(tmp_path):
    configured, detected = _kimi_on_samples(tmp_path), _kimi_on_samples(tmp_path, auto=True)
    for named, auto in zip(configured.datasets, detected.datasets, strict=True):
        want = load_dataset(named.path, named.kind, row_format=named.row_format)
        got = load_dataset(auto.path, auto.kind, row_format=auto.row_format)
        assert got.shape.auto and got.shape.format == want.shape.format
        assert [(r.id, r.messages) for r in got.rows] == [(r.id, r.messages) for r in want.rows]
