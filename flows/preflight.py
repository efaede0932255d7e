"""The preflight: the checks that find in seconds what would fail hours in, run by the pipeline before its first
stage and shown whole by `eagle3 doctor` (cli/doctor.py).

Eight groups, each in its own module: the environment (models/ranks/environment.py), the serving engine,
the chat template on a sample of each dataset, an exported draft, what vLLM needs of the target (when
vLLM serves it or extracts its hidden states), the disk, the capture's memory per GPU and node, and the run
directory (tasks/doctor/). Each
finding is PASS, WARN or FAIL with one line of what to do; any FAIL makes `eagle3 doctor` exit 1
and stops the pipeline before its first stage (`--skip-checks` skips them, said in the log). What
a group needs that is not there yet (no server launched, no records, no export) is a PASS saying
so, not a guess.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.plan import capture_plan, memory_plans
from flows.train import train_job
from models.common.findings import Finding, failed
from models.ranks.environment import environment_checks
from models.train.checkpoint import optimisation_settings, variant_settings
from settings.hub_paths import is_hub_path
from settings.layout import RUN_DRAFTS
from settings.run import RunConfig
from settings.stages import STAGES, Stage
from tasks.capture.plan import TargetConfigMissing, capture_dtype, capture_layers, read_target_config, target_shape
from tasks.datasets.hub import dataset_source
from tasks.runtime.launch_ranks import rank_device

if TYPE_CHECKING:
    from tasks.doctor.draft import ServedDraft
    from tasks.doctor.vllm_target import VllmServer


class PreflightFailed(RuntimeError):
    """A check failed before the first stage: nothing was started."""


def doctor_findings(
    config: RunConfig, stages: list[Stage] | None = None, *, engine: bool = True, eval_draft: str | None = None
) -> list[tuple[str, Finding]]:
    """(group, finding) for every check that matters to `stages` (None: every check, `eagle3 doctor`'s);
    `engine`: reach a running server too; `eval_draft`: the draft the eval measures instead of eval.draft
    (`eagle3 eval --draft DIR`).

    The draft the eval will serve is checked against the rules of what serves it (`served_draft`), unless the train
    stage runs first and replaces it.
    """
    standalone = stages is None
    stages = list(STAGES) if stages is None else stages
    served = served_draft(config, stages, eval_draft, standalone=standalone)
    out: list[tuple[str, Finding]] = []
    out += [("environment", f) for f in _environment(config, stages)]
    target, tokenizer, note = _target(config)
    if note is not None:
        out.append(("target", note))
    template = _template(config, tokenizer) if tokenizer is not None else None
    if (
        "generate" in stages
        and engine
        and config.server.launch == "none"
        and any(d.kind == "generate" for d in config.datasets)
    ):
        out += [
            ("engine", f)
            for f in engine_checks(
                config, vocab_size=target.get("vocab_size"), longest=template.longest_prompts if template else {}
            )
        ]
    elif "generate" in stages and config.server.launch != "none":
        out.append(
            (
                "engine",
                Finding(
                    "engine",
                    "PASS",
                    f"server.launch: {config.server.launch}: the pipeline starts "
                    "it for generate, and checks it once it answers",
                ),
            )
        )
    if template is not None and ({"generate", "records"} & set(stages)):
        out += [("chat template", f) for f in template.findings]
    if target and served is not None:
        out += [("draft", f) for f in _draft(config, target, served)]
    if target and "vllm" in (config.server.engine, config.capture.backend):
        out += [("vllm target", f) for f in _vllm_target(config, target, stages, engine=engine, served=served)]
    if target and ({"generate", "records", "capture"} & set(stages)):
        out += [("disk", f) for f in _disk(config)]
    if "capture" in stages:  # from config.json alone: a checkpoint without its tokenizer is enough
        out += [("memory", f) for f in _memory(config)]
    out += [("run directory", f) for f in _run_dir(config, capture="capture" in stages, generate="generate" in stages)]
    return out


def engine_checks(
    config: RunConfig, *, vocab_size: int | None = None, longest: dict[str, int] | None = None
) -> list[Finding]:
    """The engine group alone (the pipeline runs it once the servers it launched answer); `vocab_size` and
    `longest` (the longest sampled prompt of each dataset) are read from the target when not given."""
    from tasks.serving.engine_checks import engine_findings

    if longest is None:
        target, tokenizer, _ = _target(config)
        vocab_size = target.get("vocab_size")
        longest = _template(config, tokenizer).longest_prompts if tokenizer is not None else {}
    return engine_findings(
        config.server,
        target_path=config.target.path,
        vocab_size=vocab_size,
        max_new_tokens=config.sampling.max_new_tokens,
        longest_prompts=longest,
    )


def preflight(config: RunConfig, stages: list[Stage], log: Any, eval_draft: str | None = None) -> None:
    """The checks for `stages` before the first one (the engine's only when it is already running), with the draft
    `eval_draft` (`--draft`) for the eval's when given: the table goes to `log`; PreflightFailed naming each FAIL."""
    started = time.monotonic()
    findings = doctor_findings(config, stages, engine=config.server.launch == "none", eval_draft=eval_draft)
    report(findings, log, title=f"preflight checks for {', '.join(stages)} ({time.monotonic() - started:.1f} s)")


def report(findings: list[tuple[str, Finding]], log: Any, *, title: str) -> None:
    """Log each finding (`log.info`/`warning`/`error`), then raise PreflightFailed if one is a FAIL."""
    for group, f in findings:
        line = f"{f.status} {group}: {short_name(group, f)}: {f.detail}" + (f" -> {f.advice}" if f.advice else "")
        {"PASS": log.info, "WARN": log.warning, "FAIL": log.error}[f.status]("%s", line)
    bad = failed([f for _, f in findings])
    if bad:
        raise PreflightFailed(
            f"{title}: {len(bad)} failed: "
            + "; ".join(f"{f.name}: {f.detail}" for f in bad)
            + ". Fix them (`eagle3 doctor CONFIG` shows every check), or run with --skip-checks"
        )
    log.info(
        "%s: %d passed, %d warnings",
        title,
        sum(f.status == "PASS" for _, f in findings),
        sum(f.status == "WARN" for _, f in findings),
    )


def short_name(group: str, f: Finding) -> str:
    """The check's name without its group's (`chat template: B1` in group `chat template` is `B1`)."""
    return f.name.removeprefix(f"{group}: ") if f.name != group else f.name


# --- the groups ------------------------------------------------------------------------------


def _environment(config: RunConfig, stages: list[Stage]) -> list[Finding]:
    ranks = [s for s in ("capture", "train") if s in stages]
    device = "cuda" if any(rank_device(getattr(config, s).launcher) == "cuda" for s in ranks) else "cpu"
    c = config.capture
    ops = ("async_io",) if "capture" in stages and c.mode == "zero3" and c.offload == "nvme" else ()
    several = any(getattr(config, s).num_gpus > 1 for s in ranks)
    found = environment_checks(
        device,
        pipeline=True,
        ops=ops,
        allreduce=several,
        install_hint="pip install -e . in this environment (the ranks import it)",
    )
    if device == "cpu":  # said, so that a CPU run is never mistaken for a GPU one
        found = [
            Finding(
                f.name,
                f.status,
                f"{f.detail} (no CUDA: the ranks run on CPU)" if f.name == "device" else f.detail,
                f.advice,
            )
            for f in found
        ]
    return found


def _target(config: RunConfig) -> tuple[dict[str, Any], Any, Finding | None]:
    """The target's text config (as a dict) and its tokenizer; else ({}, None, the finding that says why)."""
    from transformers import AutoConfig, AutoTokenizer

    from models.target.tokenizer import RemoteTokenizerNotTrusted, check_tokenizer_trust

    path, trust = config.target.path, config.target.trust_remote_code
    if config.target.build_tiny_target and not (Path(path) / "config.json").is_file():
        return (
            {},
            None,
            Finding(
                "target",
                "PASS",
                f"{path}: not built yet; the pipeline builds the tiny demo target "
                "first (the checks that need it run then)",
            ),
        )
    local = Path(path).is_dir()  # else a Hub id: read from the local cache only, in seconds, never downloaded here
    try:
        check_tokenizer_trust(path, trust)
    except RemoteTokenizerNotTrusted as exc:
        return {}, None, Finding("target", "FAIL", str(exc).split(". ", 1)[0], "set target.trust_remote_code: true")
    try:
        loaded = AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=not local)
        text = loaded.get_text_config() if hasattr(loaded, "get_text_config") else loaded
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust, local_files_only=not local)
    except Exception as exc:  # noqa: BLE001 - a wrong path, a Hub id not in the cache, a broken tokenizer.json
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        where = "" if local else " (not a directory here, and not in the Hugging Face cache)"
        return (
            {},
            None,
            Finding(
                "target",
                "FAIL",
                f"cannot load {path}{where}: {reason}",
                "set target.path to a local checkpoint directory (config.json + tokenizer)",
            ),
        )
    return text.to_dict(), tokenizer, None


def _template(config: RunConfig, tokenizer: Any):
    from tasks.doctor.chat_template import template_findings

    # a missing file is `eagle3 validate`'s to name; a Hub dataset is sampled from the local cache
    present = [
        (d.name, dataset_source(d, config.layout), d.kind)
        for d in config.datasets
        if d.path.exists() or is_hub_path(d.path)
    ]
    formats = {d.name: d.row_format for d in config.datasets}
    return template_findings(tokenizer, present, on_rewrite=config.records.on_rewrite, formats=formats)


def served_draft(
    config: RunConfig, stages: list[Stage], eval_draft: str | None = None, *, standalone: bool = False
) -> ServedDraft | None:
    """The draft the eval stage of `stages` will serve (`eval_draft`, else eval.draft), and what serves it; None when
    no stage serves one now (no eval, or the train stage runs first and writes the export the eval measures).

    `standalone`: `eagle3 doctor`, which checks the existing export even when a run would train first, and says "not
    there yet" as a PASS.
    """
    from tasks.doctor.draft import ServedDraft

    if "eval" not in stages:
        return None
    chosen = eval_draft or config.eval.draft
    ours = chosen in RUN_DRAFTS
    if ours and "train" in stages and not standalone:
        return None
    backend, s = config.eval.backend, config.server
    return ServedDraft(
        path=config.layout.eval_of(chosen)[0],
        chosen=f"--draft {chosen}" if eval_draft else f"eval.draft: {chosen}",
        ours=ours,
        engine=None if backend == "hf" else "dev" if s.launch == "dev" else s.engine,
        in_process=backend != "engine",
        required=not standalone,
    )


def _draft(config: RunConfig, target: dict[str, Any], served: ServedDraft) -> list[Finding]:
    from tasks.doctor.draft import draft_findings

    layers = capture_layers(int(target["num_hidden_layers"]), config.capture.aux_layers)
    return draft_findings(
        served,
        trained_layers=layers,
        vocab_size=int(target["vocab_size"]),
        hidden_size=int(target["hidden_size"]),
    )


def _vllm_target(
    config: RunConfig, target: dict[str, Any], stages: list[Stage], *, engine: bool, served: ServedDraft | None
) -> list[Finding]:
    """What vLLM needs of the target, for the vLLM servers `stages` use; `engine`: ask a running one its version;
    `served`: the draft the engine eval serves, when it exists already (`served_draft`)."""
    from tasks.doctor.vllm_target import vllm_target_findings
    from tasks.runtime.launch_ranks import cuda_available

    try:
        aux = capture_layers(int(target["num_hidden_layers"]), config.capture.aux_layers)
    except ValueError:  # capture.aux_layers: said by the draft and run directory checks
        aux = None
    servers = []
    if config.server.engine == "vllm" and {"generate", "eval"} & set(stages):
        draft = "eval" in stages and config.eval.backend != "hf"
        servers.append(_vllm_server(config, aux, draft=draft, served=served, engine=engine))
    if config.capture.backend == "vllm" and "capture" in stages:
        servers.append(_vllm_capture_server(config, aux, int(target["num_hidden_layers"]), engine=engine))
    return vllm_target_findings(config.target.path, servers, cuda=cuda_available())


def _vllm_server(
    config: RunConfig, aux: list[int] | None, *, draft: bool, served: ServedDraft | None, engine: bool
) -> VllmServer:
    """The server section's vLLM: when the engine eval serves a draft, with the aux ids of the draft the train stage
    writes (the capture's layers) and those of the draft it serves (`served`: the export there now, ours or another
    trainer's)."""
    from models.export.format import vllm_aux_ids
    from tasks.doctor.vllm_target import VllmServer, export_aux_ids, export_is_mla

    s = config.server
    ids = []
    ours = served is None or served.ours
    if draft and aux and ours:
        ids.append(("draft", vllm_aux_ids(aux)))
    if draft and served is not None and (found := export_aux_ids(served.path)) is not None:
        ids.append(("export" if served.ours else served.setting, found))
    version = _vllm_version(s, s.endpoints) if engine and s.launch == "none" else None
    command = s.command if s.launch == "command" else None
    mla = config.train.draft_arch == "mla" if ours else export_is_mla(served.path) if served is not None else False
    return VllmServer("server", draft, tuple(ids), command, version, mla_draft=draft and mla)


def _vllm_capture_server(config: RunConfig, aux: list[int] | None, layers: int, *, engine: bool) -> VllmServer:
    """capture.engine's vLLM: the extraction's ids (the aux layers' outputs, then the end layer's)."""
    from models.capture.vllm_hidden import engine_layer_ids
    from tasks.doctor.vllm_target import VllmServer

    e = config.capture.engine
    ids = (("capture", engine_layer_ids(aux, layers)),) if aux else ()
    version = _vllm_version(e, [e.url]) if engine and e.launch == "none" else None
    return VllmServer("capture.engine", False, ids, e.command if e.launch == "command" else None, version)


def _vllm_version(settings: Any, urls: list[str]) -> str | None:
    """The version the running vLLM at `urls` says (None: not known; the engine group says why)."""
    from tasks.doctor.vllm_target import served_version

    try:
        return served_version(urls, settings.api_key())
    except RuntimeError:  # its API key's variable is not set: the engine group's FAIL
        return None


def _disk(config: RunConfig) -> list[Finding]:
    from tasks.doctor.disk import disk_findings

    try:
        plan = capture_plan(config)
    except Exception as exc:  # noqa: BLE001 - the target's config unreadable: said by the target check
        return [Finding("disk: capture", "WARN", f"no plan: {exc}"[:200], "point target.path at a local checkpoint")]
    budgets = sum(d.token_budget or 0 for d in config.datasets if d.kind == "generate")
    return disk_findings(plan, budget_tokens=budgets, run_dir=config.run_dir)


def _memory(config: RunConfig) -> list[Finding]:
    """The configured capture setup's memory per GPU and node (`eagle3 plan` prints every setup's)."""
    from tasks.doctor.memory import memory_finding

    try:
        setups = memory_plans(config, read_target_config(config.target.path, download=False))
    except (TargetConfigMissing, ValueError) as exc:  # unreadable: said by the target check; or not countable
        return [Finding("memory: capture", "WARN", f"no plan: {exc}"[:300], "point target.path at a local checkpoint")]
    chosen = next(s for s in setups if s.configured)
    return [memory_finding(chosen.plan, enforced=chosen.enforced)]


def _run_dir(config: RunConfig, *, capture: bool, generate: bool) -> list[Finding]:
    """The run directory's checks; `capture`: the capture stage runs, so its shards are checked too; `generate`: the
    generate stage runs, so the engine and target its responses were made with are compared with the config's."""
    from tasks.doctor.run_dir import run_dir_findings, shards_finding
    from tasks.generate.provenance import Provenance, declared_engine, target_fingerprint

    job = train_job(config)
    settings = optimisation_settings(job, config.world_size(config.train)) | variant_settings(job)
    s, path = config.server, config.target.path
    # as the config declares it (a running server, launch none, says what it is only to the generate stage)
    current = Provenance(
        declared_engine(s.launch, s.engine, s.command), path, target_fingerprint(path), launch=s.launch
    )
    found = run_dir_findings(
        config.run_dir,
        checkpoint_dir=config.layout.checkpoints,
        settings=settings,
        generated_by=current if generate else None,
    )
    if not capture:
        return found
    c = config.capture
    try:
        shape = target_shape(config.target.path, download=False)
        layers = capture_layers(shape.num_layers, c.aux_layers)
    except Exception:  # noqa: BLE001 - the target's config or capture.aux_layers: said by the target and draft checks
        return found
    want = {"hidden_size": shape.hidden_size, "aux_layers": layers, "dtype": capture_dtype(shape, c.dtype)}
    return [*found, shards_finding(config.layout.hidden_dir, want | {"storage": c.storage})]
