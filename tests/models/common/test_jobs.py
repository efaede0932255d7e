"""Job specs: every setting declared once, shared by the run config and the jobs; JSON jobs checked on load."""

from __future__ import annotations

import json

import pytest

from models.common.job_files import CaptureJobFile, EvalJobFile, TrainJobFile, load_job
from models.common.jobs import GenerateJob, RecordsJob
from settings.base import StrictModel
from settings.capture import CaptureConfig, CaptureSettings, EngineConfig, VllmCaptureSettings
from settings.dataset import DatasetConfig
from settings.distributed import DistributedConfig, Nodes
from settings.eval import EvalConfig
from settings.generate import GenerateConfig
from settings.records import RecordsConfig
from settings.run import RunConfig
from settings.sampling import SamplingConfig
from settings.server import ServerConfig, ServerSettings
from settings.target import Target
from settings.train import TrainConfig
from tasks.runtime.launch_ranks import write_job

# (run config section, the spec the pipeline builds from it, the settings they share: None = all in common)
PAIRS = [
    (ServerConfig, ServerSettings, None),
    (EngineConfig, VllmCaptureSettings, None),  # capture.engine: the vLLM server of capture.backend vllm
    (GenerateConfig, GenerateJob, None),
    (RecordsConfig, RecordsJob, None),
    (CaptureConfig, CaptureJobFile, None),
    (TrainConfig, TrainJobFile, None),
    (EvalConfig, EvalJobFile, None),
    (DistributedConfig, Nodes, None),  # what the launcher of a capture or train job reads
    # the optimizer and DeepSpeed settings travel in the train job; each rank derives its DeepSpeed config from them
    (
        TrainConfig,
        TrainJobFile,
        {
            "precision",
            "grad_accum",
            "weight_decay",
            "adam_betas",
            "adam_eps",
            "torch_adam",
            "grad_clip",
            "zero_stage",
            "lr",
            "warmup_ratio",
            "min_lr_ratio",
        },
    ),
    # across stages only what is the same setting (capture's max_batch_tokens is not train's)
    (CaptureConfig, TrainJobFile, {"aux_layers"}),  # captured, then trained for
    (TrainConfig, EvalJobFile, {"eval_fraction", "seed"}),  # the held-out split and the untrained draft
    (CaptureConfig, TrainConfig, {"num_gpus", "launcher", "retries", "retry_delay_s"}),  # launching a job
]


# sections every job file carries whole, as a field of its own (one class: nothing to drift)
CARRIED = {Target: "every job file's `target` (models/common/job_files.py JobFile)"}

# sections no job reads, and why: their values reach the stages in another form
NO_JOB = {
    SamplingConfig: "sent with every request as the engine's sampling parameters (GenerateJob.sampling_params)",
    DatasetConfig: "each dataset's name, path and budget are arguments of its generate task",
}


def test_every_section_of_the_run_config_is_checked():
    sections = {field.annotation for field in RunConfig.model_fields.values() if isinstance(field.annotation, type)}
    sections.add(DatasetConfig)  # datasets: list[DatasetConfig]
    sections |= {EngineConfig}  # capture.engine
    checked = {section for section, _, _ in PAIRS} | set(CARRIED) | set(NO_JOB)
    missing = sorted(s.__name__ for s in sections if issubclass(s, StrictModel) and s not in checked)
    assert not missing, f"sections neither paired with their job in PAIRS nor listed in CARRIED or NO_JOB: {missing}"


@pytest.mark.parametrize("job", [CaptureJobFile, TrainJobFile, EvalJobFile])
def test_every_job_file_carries_the_target_section_itself(job):
    assert job.model_fields["target"].annotation is Target


def owner(cls: type[StrictModel], name: str) -> type:
    """The class whose body declares field `name` (with its default and description)."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


@pytest.mark.parametrize("section, spec, names", PAIRS, ids=lambda c: getattr(c, "__name__", ""))
def test_no_setting_has_two_defaults(section, spec, names):
    shared = set(section.model_fields) & set(spec.model_fields)
    if names is not None:
        assert names <= shared
        shared = names
    assert shared, "a pair with nothing in common tests nothing"
    for name in sorted(shared):
        a, b = section.model_fields[name], spec.model_fields[name]
        if a.is_required() or b.is_required():
            continue  # the pipeline fills it in: no default to drift
        assert owner(section, name) is owner(spec, name), (
            f"{name} is declared in {owner(section, name).__name__} and again in {owner(spec, name).__name__}"
        )
        assert a.get_default(call_default_factory=True) == b.get_default(call_default_factory=True)


def test_a_section_and_its_job_share_the_declarations_not_copies():
    # the values a flow hands over are exactly the section's, by field name
    capture = CaptureConfig(max_batch_tokens=4096, shard_tokens=999, aux_layers=[1, 2, 3])
    job = CaptureJobFile(
        **capture.pick(CaptureSettings), target=Target(path="t"), out_dir="h", device="cpu", launch_tokens=None
    )
    assert (job.max_batch_tokens, job.shard_tokens, job.aux_layers, job.mode) == (4096, 999, [1, 2, 3], "replicate")


@pytest.mark.parametrize("value", ["fp8", "float8_e4m3fn", "FP8"])
def test_fp8_as_a_capture_dtype_points_at_capture_storage(value):
    said = f"'{value}': capture.dtype is what the target runs in; for fp8 set capture.storage: fp8"
    with pytest.raises(ValueError, match=said):
        CaptureConfig(dtype=value)
    assert CaptureConfig(dtype="bfloat16", storage="fp8").storage == "fp8"


@pytest.mark.parametrize("aux", [[2, 3, 4], [0, 3, 4], [1, 4, 3]])
def test_aux_layers_the_export_would_refuse_are_refused_at_config_time(aux):
    # the export refuses them (models/export/sglang.py: SGLang versions disagree on a first id other
    # than 1; both engines concatenate in layer order), so a run must not capture and train for them
    with pytest.raises(
        ValueError, match=r"must be increasing and start at layer 1 .* got \[" + ", ".join(map(str, aux))
    ):
        CaptureConfig(aux_layers=aux)
    assert CaptureConfig(aux_layers=[1, 3, 4]).aux_layers == [1, 3, 4]


def test_a_job_file_round_trips_and_bad_keys_or_values_are_named(tmp_path):
    job = CaptureJobFile(
        target=Target(path="t"),
        out_dir="h",
        device="cpu",
        launch_tokens=None,
        datasets=[{"name": "A", "records_dir": "r"}],
    )
    path = tmp_path / "jobs" / "capture.json"
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    assert load_job(CaptureJobFile, path) == job
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "shard_tokenz": 5, "max_batch_tokens": True, "mode": "zero4"}))
    with pytest.raises(ValueError) as caught:
        load_job(CaptureJobFile, path)
    text = str(caught.value)
    assert text.startswith(f"{path}: not a valid CaptureJobFile: ")
    assert "shard_tokenz: Extra inputs are not permitted" in text
    assert "max_batch_tokens: Value error, must be a whole number, not true/false" in text
    assert "mode: Input should be 'replicate' or 'zero3'" in text
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the CaptureJobFile"):
        load_job(CaptureJobFile, path)


def test_train_job_needs_the_data_of_its_mode():
    base = dict(target=Target(path="t"), out_dir="d", token_counts="c", device="cpu")
    with pytest.raises(ValueError, match="mode offline needs hidden_dir"):
        TrainJobFile(**base)
    with pytest.raises(ValueError, match="mode online needs datasets"):
        TrainJobFile(**base, mode="online")
    assert TrainJobFile(**base, hidden_dir="h").grad_accum == 1
