"""Typed run config: presets load, mistakes are named by key path with what is expected."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from flows.config.file import ConfigError, dump_config, load_config, parse_config
from models.common.job_files import dataset_records
from settings.run import RunConfig

REPO = Path(__file__).resolve().parents[3]

MINIMAL = {
    "run_dir": "runs/x",
    "target": {"path": "models/t"},
    "datasets": [
        {"name": "A1", "kind": "passthrough", "path": "a.jsonl"},
        {"name": "B1", "kind": "generate", "path": "b.jsonl", "token_budget": 1000},
    ],
}


def problems(data, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="cfg.yaml", **kw)
    assert str(info.value).startswith("cfg.yaml: invalid config")
    return info.value.problems


def test_minimal_config_gets_documented_defaults(tmp_path):
    config = parse_config(copy.deepcopy(MINIMAL), base=tmp_path)
    assert config.run_dir == tmp_path / "runs/x"
    assert config.datasets[1].path == tmp_path / "b.jsonl"
    assert config.target.path == "models/t" or config.target.path == str(tmp_path / "models/t")
    assert config.server.url == "http://127.0.0.1:30000"
    assert config.server.max_concurrency == 64
    assert config.sampling.max_new_tokens == 16384  # never SGLang's silent default of 128
    assert config.datasets[0].on_bad_row == "fail"
    assert config.datasets[1].token_budget == 1000


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, RunConfig.__base__):
                walk(field.annotation)
            else:
                assert field.description, f"{model.__name__}.{name} has no description"

    walk(RunConfig)
    from settings.dataset import DatasetConfig

    walk(DatasetConfig)


def test_misspelled_key_is_named_with_a_suggestion():
    data = copy.deepcopy(MINIMAL)
    data["server"] = {"max_concurency": 8}
    (line,) = problems(data)
    assert line.startswith("server.max_concurency: unknown key")
    assert "did you mean 'max_concurrency'?" in line


def test_misspelled_key_inside_a_dataset_names_its_index():
    data = copy.deepcopy(MINIMAL)
    data["datasets"][1]["tokens_budget"] = 5
    (line,) = problems(data)
    assert line.startswith("datasets[1].tokens_budget: unknown key")
    assert "'token_budget'" in line


def test_misspelled_top_level_key():
    data = copy.deepcopy(MINIMAL)
    data["samplng"] = {}
    (line,) = problems(data)
    assert line.startswith("samplng: unknown key; did you mean 'sampling'?")


def test_all_problems_are_reported_at_once():
    data = copy.deepcopy(MINIMAL)
    data["datasets"][1]["token_budget"] = -5
    data["datasets"][0]["kind"] = "gen"
    data["sampling"] = {"top_p": 1.5, "top_k": 0}
    lines = problems(data)
    assert len(lines) == 4
    joined = "\n".join(lines)
    assert "datasets[1].token_budget: Input should be greater than or equal to 1 (got -5)" in joined
    assert "datasets[0].kind: Input should be 'passthrough' or 'generate' (got 'gen')" in joined
    assert "sampling.top_p: Input should be less than or equal to 1 (got 1.5)" in joined
    assert "sampling.top_k: must be -1 (off) or a positive number of candidates (got 0)" in joined


def test_missing_required_keys():
    lines = problems({"datasets": []})
    assert "run_dir: required key is missing" in lines
    assert "target: required key is missing" in lines
    assert any(line.startswith("datasets: List should have at least 1 item") for line in lines)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda d: d["datasets"][0].update(token_budget=5), "token_budget applies to generate datasets only"),
        (lambda d: d["datasets"][0].update(turns="all"), "turns applies to generate datasets only"),
        (lambda d: d["datasets"][0].update(max_in_flight=1), "max_in_flight applies to generate datasets only"),
        (lambda d: d["datasets"][1].update(turns="every"), "turns"),
        (lambda d: d["datasets"][1].update(name="A1"), "dataset name 'A1' is used twice"),
        (lambda d: d["datasets"][1].update(name="../evil"), "cannot be a directory name"),
        (lambda d: d.update(server={"url": "localhost:30000"}), "server.url: must be an http(s) URL"),
        (lambda d: d.update(sampling={"stop_token_ids": []}), "sampling.stop_token_ids: must be a non-empty list"),
        (
            lambda d: d["datasets"][1].update(on_bad_row="ignore"),
            "datasets[1].on_bad_row: Input should be 'fail' or 'skip'",
        ),
        (lambda d: d.update(datasets="b.jsonl"), "datasets: Input should be a valid list"),
        (lambda d: d.update(train={"adam_betas": [0.9, 1.0]}), "each AdamW beta must be in (0, 1), got [0.9, 1.0]"),
        (lambda d: d.update(train={"adam_betas": [0.9]}), "train.adam_betas"),
        (
            lambda d: d.update(train={"norm_before_fc": True, "draft_variant": "eagle3.1"}),
            "norm_before_fc and draft_variant eagle3.1 are exclusive",
        ),
        (
            lambda d: d.update(train={"norm_before_fc": True, "draft_arch": "mla"}),
            "draft_arch mla and norm_before_fc are exclusive",
        ),
        (lambda d: d.update(train={"draft_arch": "gqa"}), "train.draft_arch: Input should be 'llama' or 'mla'"),
        (lambda d: d.update(train={"draft_rope": "yarn"}), "train.draft_rope: Input should be 'target' or 'plain'"),
        (
            lambda d: d.update(train={"norm_before_residual": True}, server={"url": "http://h:1", "engine": "sglang"}),
            "train.norm_before_residual: SGLang 0.5.23 (srt/models/llama_eagle3.py LlamaDecoderLayer) always keeps",
        ),
    ],
)
def test_semantic_errors(change, expected):
    data = copy.deepcopy(MINIMAL)
    change(data)
    assert any(expected in line for line in problems(data)), problems(data)


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run_dir: x\ntarget: {path: t\ndatasets: []\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "line 3" in info.value.problems[0] or "line 2" in info.value.problems[0]


def test_top_level_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


def test_relative_paths_resolve_against_base_and_hub_ids_stay(tmp_path):
    data = copy.deepcopy(MINIMAL)
    data["target"] = {"path": "moonshotai/Kimi-K2.5"}
    config = parse_config(data, base=tmp_path)
    assert config.target.path == "moonshotai/Kimi-K2.5"
    data["target"] = {"path": "./local/model"}
    assert parse_config(data, base=tmp_path).target.path == str(tmp_path / "local/model")


def test_the_layout_puts_the_output_directories_where_the_settings_say(tmp_path):
    config = parse_config(copy.deepcopy(MINIMAL), base=tmp_path)
    layout = config.layout  # nothing set: all of it under run_dir
    assert (layout.run_dir, layout.hidden_dir, layout.engine_dir, layout.draft_dir) == (
        tmp_path / "runs/x",
        tmp_path / "runs/x/hidden",
        tmp_path / "runs/x/engine",
        tmp_path / "runs/x/draft",
    )
    assert dataset_records(config)[1].records_dir == str(tmp_path / "runs/x/records/B1")
    data = {
        **copy.deepcopy(MINIMAL),
        "capture": {"out_dir": "big/hidden", "backend": "vllm", "engine": {"shared_dir": "/dev/shm/c"}},
        "train": {"out_dir": "drafts/k25"},
    }
    config = parse_config(data, base=tmp_path)
    layout = config.layout
    assert (layout.hidden_dir, layout.engine_dir, layout.draft_dir) == (
        tmp_path / "big/hidden",
        Path("/dev/shm/c"),
        tmp_path / "drafts/k25",
    )
    assert (
        layout.final == tmp_path / "drafts/k25/final"
        and layout.token_counts == tmp_path / "runs/x/records/token_counts.parquet"
    )
    assert config.written_dirs(["capture", "train"]) == [
        ("capture.out_dir", tmp_path / "big/hidden"),
        ("capture.engine.shared_dir", Path("/dev/shm/c")),
        ("train.out_dir", tmp_path / "drafts/k25"),
    ]
    assert config.read_dirs(["train"]) == [("capture.out_dir", tmp_path / "big/hidden")]


def test_dump_round_trips(tmp_path):
    config = parse_config(copy.deepcopy(MINIMAL), base=tmp_path)
    again = parse_config(yaml.safe_load(dump_config(config)), base=tmp_path)
    assert again == config


def test_demo_preset_loads():
    config = load_config(REPO / "configs/demo.yaml", base=REPO)
    kinds = {d.name: d.kind for d in config.datasets}
    assert list(kinds.values()).count("passthrough") == 1
    assert list(kinds.values()).count("generate") >= 3
    assert config.target.build_tiny_target
    assert all(d.path.exists() for d in config.datasets)
    assert [(b.name, b.limit) for b in config.eval.benchmarks] == [("mt_bench", 8), ("gsm8k", 8), ("humaneval", 8)]
    assert all(Path(b.path).is_file() for b in config.eval.benchmarks)


def test_kimi_preset_is_the_reference_run():
    config = load_config(REPO / "configs/kimi-k25.yaml", base=REPO)
    names = [d.name for d in config.datasets]
    assert names[:2] == ["A1_deepswekimi", "A2_kimik25"]
    assert all(d.kind == "passthrough" for d in config.datasets[:2])
    generate = config.datasets[2:]
    assert [d.name.split("_")[0] for d in generate] == [f"B{i}" for i in range(1, 9)]
    assert names[2:6] == ["B1_glaive", "B2_opencodeinstruct", "B3_magicoder", "B4_mixturethoughts"]
    assert all(d.kind == "generate" and d.token_budget == 10_000_000 for d in generate)
    assert config.sampling.stop_token_ids == [163586]
    assert config.target.trust_remote_code
    assert config.target.path == "moonshotai/Kimi-K2.5"
    # the eval is measured in SGLang serving the target + draft: the pipeline starts the recipe, the eval adds the draft
    assert config.eval.backend == "engine"
    assert config.server.launch == "command" and config.server.command == ["bash", "deploy/sglang-kimi-k25.sh"]
    assert not any(w.startswith("--speculative") for w in config.server.command)


def test_the_one_gpu_preset_is_a_mid_size_run_with_published_anchors():
    from tasks.eval.benchmarks import published_anchors

    config = load_config(REPO / "configs/llama-3.1-8b-1gpu.yaml", base=REPO)
    assert (config.train.num_gpus, config.train.mode, config.eval.backend) == (1, "online", "both")
    assert sum(d.token_budget or 0 for d in config.datasets) == 10_000_000
    assert all(str(d.path).startswith("hf:") for d in config.datasets)
    # the anchors REFERENCE.md records for Llama-3.1-8B (SpecBundle: GSM8K 2.55, HumanEval 3.34)
    anchors = [published_anchors(config.target.path, b.name)[0] for b in config.eval.benchmarks]
    assert [a["acceptance_length"] for a in anchors] == [2.55, 3.34]


def _number_fields():
    """(key path, data change) for every int/float field of every section, present and future."""
    import types
    import typing

    from settings.dataset import DatasetConfig

    def numeric(annotation):
        members = (
            typing.get_args(annotation)
            if typing.get_origin(annotation) in (typing.Union, types.UnionType)
            else (annotation,)
        )
        return bool({int, float} & set(members)) and bool not in members

    out = []
    for section, field in RunConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, RunConfig.__base__):
            out += [
                (f"{section}.{name}", section, name) for name, f in model.model_fields.items() if numeric(f.annotation)
            ]
    out += [
        (f"datasets[1].{name}", "datasets", name)
        for name, f in DatasetConfig.model_fields.items()
        if numeric(f.annotation)
    ]
    return out


NUMBER_FIELDS = _number_fields()


def test_number_fields_are_found():
    keys = [key for key, _, _ in NUMBER_FIELDS]
    assert {
        "server.max_concurrency",
        "server.request_timeout_s",
        "sampling.temperature",
        "train.seed",
        "capture.disk_margin",
        "datasets[1].token_budget",
        "datasets[1].max_prompts",
    } <= set(keys)


@pytest.mark.parametrize("key,section,name", NUMBER_FIELDS, ids=[k for k, _, _ in NUMBER_FIELDS])
@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_is_never_a_number(key, section, name, flag):
    data = copy.deepcopy(MINIMAL)
    if section == "datasets":
        data["datasets"][1][name] = flag
    else:
        data[section] = {name: flag}
    lines = problems(data)
    assert any(
        line.startswith(f"{key}: must be a ") and f"number, not true/false (got {flag})" in line for line in lines
    ), lines


def test_a_bool_inside_a_list_or_mapping_of_numbers_is_named():
    data = copy.deepcopy(MINIMAL)
    data["sampling"] = {"stop_token_ids": [2, True]}
    data["capture"] = {"aux_layers": [False, 3, 5]}
    data["train"] = {"draft_overrides": {"head_dim": True}}
    assert sorted(problems(data)) == [
        "capture.aux_layers: item 0 must be a whole number, not true/false (got False)",
        "sampling.stop_token_ids: item 1 must be a whole number, not true/false (got True)",
        "train.draft_overrides: 'head_dim' must be a number, not true/false (got True)",
    ]


def test_bools_and_numbers_still_load_where_they_belong(tmp_path):
    data = copy.deepcopy(MINIMAL)
    data["target"]["trust_remote_code"] = True
    data["server"] = {"max_concurrency": 8.0, "request_timeout_s": 30}
    data["records"] = {"keep_truncated": False}
    config = parse_config(data, base=tmp_path)
    assert (config.target.trust_remote_code, config.server.max_concurrency, config.server.request_timeout_s) == (
        True,
        8,
        30.0,
    )
    assert config.records.keep_truncated is False
    config.server.max_concurrency = 16  # assignment is validated too
    with pytest.raises(ValueError, match="must be a whole number, not true/false"):
        config.server.max_concurrency = True


URL_FORM = "scheme://host:port, e.g. http://127.0.0.1:30000"


@pytest.mark.parametrize(
    "url, expected",
    [
        (
            "http://127.0.0.1:99999",
            f"server.url: port '99999' is not a number from 1 to 65535; the form is {URL_FORM} (got 'http://127.0.0.1:99999')",
        ),
        ("http://127.0.0.1:0", "server.url: port '0' is not a number from 1 to 65535"),
        ("http://127.0.0.1:", "server.url: port '' is not a number from 1 to 65535"),
        ("http://127.0.0.1:30k", "server.url: port '30k' is not a number from 1 to 65535"),
        (
            "http://127.0.0.1:30000/generate",
            "server.url: must be the server's base URL, scheme://host:port with no path: use 'http://127.0.0.1:30000'"
            " (SGLang's native API is at the root; the pipeline adds /generate itself) (got 'http://127.0.0.1:30000/generate')",
        ),
        (
            "http://gpu-node-3:8000/v1",
            "server.url: must be the server's base URL, scheme://host:port with no path: use 'http://gpu-node-3:8000'",
        ),
        (
            "http://h:30000?x=1",
            "server.url: must be the server's base URL, scheme://host:port with no path: use 'http://h:30000'",
        ),
        ("localhost:30000", f"server.url: must be an http(s) URL of the form {URL_FORM} (got 'localhost:30000')"),
        ("ftp://h:30000", f"server.url: must be an http(s) URL of the form {URL_FORM}"),
        ("http://", f"server.url: must be an http(s) URL of the form {URL_FORM}"),
        ("http://bad host:30000", f"server.url: must be an http(s) URL of the form {URL_FORM}"),
        ("http://user:secret@h:30000", "server.url: must not hold a user or password"),
    ],
)
def test_server_url_must_be_scheme_host_port(url, expected):
    data = copy.deepcopy(MINIMAL)
    data["server"] = {"url": url}
    (line,) = problems(data)
    assert line.startswith(expected), line


@pytest.mark.parametrize(
    "url, stored",
    [
        ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
        ("http://127.0.0.1:30000/", "http://127.0.0.1:30000"),
        ("https://sglang.example.com", "https://sglang.example.com"),  # a proxy on the default port
        ("https://sglang.example.com:8443", "https://sglang.example.com:8443"),
        ("http://[::1]:65535", "http://[::1]:65535"),
    ],
)
def test_good_server_urls_are_kept(tmp_path, url, stored):
    data = copy.deepcopy(MINIMAL)
    data["server"] = {"url": url}
    assert parse_config(data, base=tmp_path).server.url == stored


def test_run_dir_must_be_a_directory_or_absent(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    data = copy.deepcopy(MINIMAL)
    data["run_dir"] = "notes.txt"
    assert problems(data, base=tmp_path) == [
        f"run_dir: {tmp_path / 'notes.txt'} exists and is not a directory; it must be a directory or absent"
        " (point it at a new or existing directory, or move the file away)"
    ]
    data["run_dir"] = "notes.txt/run"
    (line,) = problems(data, base=tmp_path)
    assert line.startswith(
        f"run_dir: {tmp_path / 'notes.txt/run'} cannot be a directory because {tmp_path / 'notes.txt'} is a file"
    )
    data["run_dir"] = "runs/new"
    data["train"] = {"out_dir": "notes.txt"}
    (line,) = problems(data, base=tmp_path)
    assert line.startswith(f"train.out_dir: {tmp_path / 'notes.txt'} exists and is not a directory")
    del data["train"]
    assert parse_config(data, base=tmp_path).run_dir == tmp_path / "runs/new"  # absent: created later
    (tmp_path / "runs/new").mkdir(parents=True)
    assert parse_config(data, base=tmp_path).run_dir == tmp_path / "runs/new"


# --- distributed: capture and train over several nodes ------------------------------------------


def test_one_node_by_default_and_world_size_is_nodes_times_gpus(tmp_path):
    config = parse_config(copy.deepcopy(MINIMAL), base=tmp_path)
    assert (config.distributed.nnodes, config.distributed.master_addr, config.distributed.hostfile) == (1, None, None)
    assert config.world_size(config.train) == 8
    data = {
        **copy.deepcopy(MINIMAL),
        "train": {"num_gpus": 4, "launcher": "torchrun"},
        "capture": {"launcher": "torchrun"},
        "distributed": {"nnodes": 3, "master_addr": "10.0.0.5"},
    }
    config = parse_config(data, base=tmp_path)
    assert config.world_size(config.train) == 12 and config.world_size(config.capture) == 24
    assert config.layout.job("train") == tmp_path / "runs/x/jobs/train.json"


def test_several_nodes_need_a_rendezvous_or_a_hostfile(tmp_path):
    torchrun = {
        **copy.deepcopy(MINIMAL),
        "capture": {"launcher": "torchrun"},
        "train": {"launcher": "torchrun"},
        "distributed": {"nnodes": 2},
    }
    lines = problems(torchrun, base=tmp_path)
    assert lines == [
        "distributed: nnodes 2 with torchrun needs master_addr: the address of node 0 that every node reaches "
        "(its rendezvous runs there, on master_port) (capture: launcher torchrun; train: launcher torchrun)"
    ]
    deepspeed = {**torchrun, "capture": {"launcher": "deepspeed"}, "train": {"launcher": "deepspeed", "num_gpus": 4}}
    assert any("needs hostfile" in line for line in problems(deepspeed, base=tmp_path))

    hostfile = tmp_path / "hostfile"
    deepspeed["distributed"] = {"nnodes": 2, "hostfile": "hostfile"}
    assert problems(deepspeed, base=tmp_path) == [
        f"distributed: cannot read the hostfile {hostfile}: No such file or directory "
        "(capture: launcher deepspeed; train: launcher deepspeed)"
    ]
    hostfile.write_text("# two nodes\ngpu-0 slots=8\n\ngpu-1 slots=4\n")
    assert problems(deepspeed, base=tmp_path) == [
        f"distributed: num_gpus 8 per node, but the hostfile {hostfile} gives gpu-1 slots=4: every node runs "
        "num_gpus ranks (the world size is nnodes x num_gpus) (capture: launcher deepspeed)"
    ]
    deepspeed["capture"] = {"launcher": "deepspeed", "num_gpus": 4}
    config = parse_config(deepspeed, base=tmp_path)
    assert config.distributed.hostfile == hostfile and config.world_size(config.train) == 8
    deepspeed["distributed"]["nnodes"] = 3
    assert any(
        f"nnodes 3, but the hostfile {hostfile} lists 2 host(s)" in line for line in problems(deepspeed, base=tmp_path)
    )
    hostfile.write_text("gpu-0 slots=8\ngpu-0 slots=8\n")
    assert any("line 2: host 'gpu-0' is listed twice" in line for line in problems(deepspeed, base=tmp_path))


@pytest.mark.parametrize("addr", ["10.0.0.5:29500", "", "node 0"])
def test_master_addr_is_an_address_without_a_port(addr):
    data = {**copy.deepcopy(MINIMAL), "distributed": {"nnodes": 2, "master_addr": addr}}
    assert any(
        line.startswith("distributed.master_addr: must be the host name or IP address of node 0")
        for line in problems(data)
    )


# --- several servers (issue 13) -------------------------------------------------------------------


def test_servers_already_running_go_in_urls_and_launched_replicas_take_consecutive_ports(tmp_path):
    data = copy.deepcopy(MINIMAL)
    data["server"] = {"urls": ["http://box-a:30000/", "http://box-b:30000"], "max_concurrency": 32}
    server = parse_config(data, base=tmp_path).server
    assert server.endpoints == ["http://box-a:30000", "http://box-b:30000"]
    data["server"] = {"url": "http://127.0.0.1:31000", "launch": "dev", "replicas": 3}
    assert parse_config(data, base=tmp_path).server.endpoints == [
        f"http://127.0.0.1:{p}" for p in (31000, 31001, 31002)
    ]
    data["server"] = {"url": "http://[::1]:31000", "launch": "dev", "replicas": 2}
    assert parse_config(data, base=tmp_path).server.endpoints == ["http://[::1]:31000", "http://[::1]:31001"]
    data["server"] = {"url": "http://127.0.0.1:31000", "launch": "dev", "replicas": 3, "router": True}
    assert parse_config(data, base=tmp_path).server.endpoints == ["http://127.0.0.1:31000"]  # the router
    data["server"] = {
        "url": "http://127.0.0.1:31000",
        "launch": "command",
        "replicas": 2,
        "gpus_per_replica": 4,
        "command": [
            "python",
            "-m",
            "sglang.launch_server",
            "--port",
            "{port}",
            "--tp",
            4,
            "--json-model-override-args",
            '{"x": 1}',
        ],
    }
    assert parse_config(data, base=tmp_path).server.command[6] == "4"  # YAML numbers become words


@pytest.mark.parametrize(
    "server, expected",
    [
        ({"urls": []}, "server.urls: List should have at least 1 item"),
        ({"urls": ["http://a:1", "http://a:1/"]}, "server.urls: http://a:1 given more than once"),
        ({"urls": ["http://a:1", "a:2"]}, "server.urls: urls[1] must be an http(s) URL"),
        ({"urls": ["http://a:1"], "launch": "dev"}, "urls lists servers that are already running (launch: none)"),
        ({"replicas": 2}, "replicas and router are started by the pipeline: set launch: dev or command"),
        ({"router": True}, "replicas and router are started by the pipeline"),
        (
            {"launch": "command", "command": ["serve"], "replicas": 2},
            "with replicas > 1 the command must put each replica",
        ),
        ({"launch": "command", "command": ["serve", "--port", "{prot}"]}, "unknown placeholder {prot}"),
        ({"launch": "dev", "url": "http://h:65535", "replicas": 2}, "2 replicas from port 65535 go past port 65535"),
        ({"replicas": 0, "launch": "dev"}, "server.replicas: Input should be greater than or equal to 1"),
        ({"max_req_input_len": 1}, "server.max_req_input_len: Input should be greater than or equal to 2"),
    ],
)
def test_bad_server_pools_are_named(server, expected):
    data = copy.deepcopy(MINIMAL)
    data["server"] = server
    assert any(expected in line for line in problems(data)), problems(data)


# --- the engine eval (issue 14) ---------------------------------------------------------------------


def test_engine_eval_settings_and_where_it_measures(tmp_path):
    data = {
        **copy.deepcopy(MINIMAL),
        "eval": {"backend": "engine", "concurrency": 4, "baseline_url": "http://plain:30000/"},
        "server": {"urls": ["http://with-draft:30000", "http://other:30000"]},
    }
    config = parse_config(data, base=tmp_path)
    assert (config.eval.backend, config.eval.concurrency, config.eval.baseline_url) == (
        "engine",
        4,
        "http://plain:30000",
    )
    assert config.eval_server_url == "http://with-draft:30000"
    assert parse_config(copy.deepcopy(MINIMAL), base=tmp_path).eval.backend == "hf"


@pytest.mark.parametrize(
    "section, expected",
    [
        ({"eval": {"backend": "vllm"}}, "eval.backend: Input should be 'hf', 'engine' or 'both'"),
        ({"eval": {"concurrency": 0}}, "eval.concurrency: Input should be greater than or equal to 1"),
        ({"eval": {"baseline_url": "plain:30000"}}, "eval.baseline_url: must be an http(s) URL"),
        (
            {"eval": {"baseline_url": "http://plain:30000"}, "server": {"launch": "dev"}},
            "eval.baseline_url is for a server already running (server.launch: none)",
        ),
    ],
)
def test_bad_engine_eval_settings_are_named(section, expected):
    data = {**copy.deepcopy(MINIMAL), **section}
    assert any(expected in line for line in problems(data)), problems(data)


# --- published benchmarks (issue 36) ---------------------------------------------------------------


def test_benchmark_paths_resolve_like_the_datasets_and_hub_ones_stay(tmp_path):
    benchmarks = [
        {"name": "mt_bench", "path": "bench/question.jsonl"},
        {"name": "gsm8k", "path": "hf:openai/gsm8k", "config": "main", "limit": 50, "anchor": 3.2},
    ]
    config = parse_config({**copy.deepcopy(MINIMAL), "eval": {"benchmarks": benchmarks}}, base=tmp_path)
    mt, gsm = config.eval.benchmarks
    assert (mt.path, mt.limit, mt.format) == (str(tmp_path / "bench/question.jsonl"), 80, None)
    assert (gsm.path, gsm.config, gsm.split, gsm.limit, gsm.anchor) == ("hf:openai/gsm8k", "main", None, 50, 3.2)
    assert parse_config(yaml.safe_load(dump_config(config)), base=tmp_path) == config
    assert parse_config(copy.deepcopy(MINIMAL), base=tmp_path).eval.benchmarks == []


@pytest.mark.parametrize(
    "benchmark, expected",
    [
        ({"name": "g", "path": "hf:openai"}, "eval.benchmarks: g: 'hf:openai' is not a Hub dataset path: expected"),
        (
            {"name": "g", "path": "q.jsonl", "turns": 2},
            "eval.benchmarks[0].turns: unknown key; allowed keys here: name, path",
        ),
        (
            {"name": "g", "path": "q.jsonl", "format": "mmlu"},
            "eval.benchmarks[0].format: Input should be 'mt_bench', 'gsm8k', 'humaneval', 'chat' or 'ids'",
        ),
        ({"name": "context_probes", "path": "q.jsonl"}, "'context_probes' names the eval's context probes"),
        ({"name": "g", "path": "q.jsonl", "config": "main"}, "config: for hf: benchmarks only"),
        ({"path": "q.jsonl"}, "eval.benchmarks[0].name: required key is missing"),
    ],
)
def test_bad_benchmarks_are_named(benchmark, expected):
    data = {**copy.deepcopy(MINIMAL), "eval": {"benchmarks": [benchmark]}}
    assert any(expected in line for line in problems(data)), problems(data)


def test_the_demo_server_section_for_each_engine_validates(tmp_path, monkeypatch):
    import cli.demo as demo
    import cli.demo_targets as targets

    config = demo.demo_config(tmp_path / "run")
    dev = demo.demo_server(config, "dev", "http://127.0.0.1:30011")
    assert (dev.engine, dev.launch, dev.url) == ("sglang", "dev", "http://127.0.0.1:30011")
    monkeypatch.setattr(targets, "SGLANG_VENV", tmp_path / "no-sglang")
    with pytest.raises(FileNotFoundError, match="make sglang"):
        demo.demo_server(config, "sglang", "http://127.0.0.1:30011")
    (tmp_path / "no-sglang" / "bin").mkdir(parents=True)
    (tmp_path / "no-sglang" / "bin" / "python").write_text("")
    sglang = demo.demo_server(config, "sglang", "http://127.0.0.1:30011")
    assert (sglang.engine, sglang.launch) == ("sglang", "command")
    python = str(tmp_path / "no-sglang" / "bin" / "python")
    # one OpenMP thread, no torch.compile: tasks/serving/sglang.py cpu_command says why (measured 90x slower beside
    # a busy process; 2x slower starts on the Kimi target)
    assert sglang.command[:5] == [
        "env",
        "SGLANG_USE_CPU_ENGINE=1",
        "OMP_NUM_THREADS=1",
        "TORCH_COMPILE_DISABLE=1",
        python,
    ]
    assert sglang.command[sglang.command.index("--model-path") + 1] == config.target.path
    assert "--skip-tokenizer-init" in sglang.command and "intel_amx" in sglang.command
    monkeypatch.setattr(targets, "VLLM_VENV", tmp_path / "no-venv")
    with pytest.raises(FileNotFoundError, match="make vllm"):
        demo.demo_server(config, "vllm", "http://127.0.0.1:30011")
    (tmp_path / "no-venv" / "bin").mkdir(parents=True)
    (tmp_path / "no-venv" / "bin" / "python").write_text("")
    vllm = demo.demo_server(config, "vllm", "http://127.0.0.1:30011")
    assert (vllm.engine, vllm.launch) == ("vllm", "command")
    # the model in the engine core's process: tasks/serving/vllm.py cpu_command says why (one process start fewer)
    assert vllm.command[:4] == [
        "env",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "VLLM_ENABLE_V1_MULTIPROCESSING=0",
        str(tmp_path / "no-venv" / "bin" / "python"),
    ]
    assert "--no-enable-chunked-prefill" in vllm.command
    assert vllm.command[vllm.command.index("--distributed-executor-backend") + 1] == "uni"
    assert vllm.command[vllm.command.index("--model") + 1] == config.target.path


def test_vllm_is_refused_with_the_dev_server_and_the_sglang_router(tmp_path):
    base = {"run_dir": str(tmp_path / "run"), "target": {"path": "t"}, "datasets": []}
    with pytest.raises(ConfigError, match="dev server emulates SGLang only"):
        parse_config({**base, "server": {"engine": "vllm", "launch": "dev"}})
    with pytest.raises(ConfigError, match="SGLang router"):
        parse_config(
            {
                **base,
                "server": {"engine": "vllm", "launch": "command", "command": ["x", "--port", "{port}"], "router": True},
            }
        )


def test_the_optimizer_settings_reach_the_deepspeed_config(tmp_path):
    from flows.train import train_job

    data = {
        **copy.deepcopy(MINIMAL),
        "run_dir": str(tmp_path / "run"),
        "train": {"adam_betas": [0.8, 0.99], "adam_eps": 1e-6, "torch_adam": False, "weight_decay": 0.1},
    }
    from models.train.optimizer import ds_train_config

    params = ds_train_config(train_job(parse_config(data, base=tmp_path)), world_size=1, bf16=False)["optimizer"][
        "params"
    ]
    assert (params["betas"], params["eps"], params["torch_adam"], params["weight_decay"]) == (
        [0.8, 0.99],
        1e-6,
        False,
        0.1,
    )
