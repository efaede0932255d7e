"""Which engine and which target made a run's responses: recorded once, checked on every resume.

A run directory's responses are one engine's outputs of one model. Resuming it through another engine (the dev
server's SGLang emulation, a real SGLang, a real vLLM) or another target would mix two distributions in one training
set, and the run would then say it was made by the last one. So the first generate writes RUN_DIR/generated-by.json
(settings/layout.py `RunLayout.generated_by`), and every later generate, and the demo before it starts
anything, compares what it is about to use with it and refuses a difference with the reason and what to do.

What identifies them:
- the engine: what the server says it is (`reported_engine`: the dev and simulated servers mark their /server_info
  version; a real SGLang reports its version there, a real vLLM at /version and owns its /v1/models), else what the
  config declares (`declared_engine`: launch dev is the dev server; a launch command or a running server is
  server.engine). The version is recorded, not compared: an upgrade is the same engine.
- the target: its path and a fingerprint of its files (`target_fingerprint`: config, tokenizer, and a sample of each
  weights file's bytes); two paths with one fingerprint are the same target (a moved checkout).
- the model the server says it serves (SGLang's model_path, vLLM's /v1/models root), compared by its last path
  component: the only word on the weights of a server this run did not start.

A server can say what it likes: this catches the mistakes (another engine's flag, another run's directory), not a
server that lies. A run directory written before this record existed has none: the next generate adopts it (records
what it runs with, with a log line) instead of refusing it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from models.common.atomic import write_atomic
from models.common.file_errors import DamagedFile
from settings.layout import RunLayout
from tasks.responses.parquet_io import list_parts

# What each engine kind is called in messages, and how a config asks for it.
ENGINE_KINDS = {
    "dev": ("the dev server (an SGLang emulation)", "server.launch: dev (the demo: --engine dev)"),
    "sim": ("the simulated server (emulators/sim)", "the simulated server"),
    "sglang": ("a real SGLang", "a real SGLang (server.engine: sglang; the demo: --engine sglang)"),
    "vllm": ("a real vLLM", "a real vLLM (server.engine: vllm; the demo: --engine vllm)"),
}
# The /server_info version suffixes of this project's emulators (emulators/dev_server/backend.py, emulators/sim).
EMULATOR_VERSIONS = {"-eagle3-dev": "dev", "-eagle3-sim": "sim"}
TARGET_FILES = (  # the files that say what the target is and how it tokenizes, hashed whole
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SAMPLE_BYTES = 1 << 16  # per weights file, from its middle and its end: trained weights differ there, reads stay cheap


@dataclass(frozen=True)
class Provenance:
    """What makes (or made) a run's responses: the engine and the target."""

    engine: str | None
    """dev, sim, sglang or vllm (ENGINE_KINDS); None: not known (a running server, in a check before it answers)."""
    target_path: str
    """target.path as the run gives it."""
    target_fingerprint: str | None = None
    """sha256 of the target's files (`target_fingerprint`); None where the target is not on this machine."""
    engine_version: str | None = None
    """The version the server reports, for the record (not compared)."""
    served_model: str | None = None
    """The model the server says it serves (SGLang's model_path, vLLM's /v1/models root)."""
    launch: str | None = None
    """server.launch of the run that recorded it (none, dev, command), for the record."""

    def describe(self) -> str:
        """E.g. 'a real vLLM 0.11.0 on runs/tiny-target (weights 1a2b3c4d)'."""
        emulated = self.engine in EMULATOR_VERSIONS.values()  # their version says what they are, not what they follow
        version = f" {self.engine_version}" if self.engine_version and not emulated else ""
        weights = f" (weights {self.target_fingerprint[:8]})" if self.target_fingerprint else ""
        served = (
            f", serving {self.served_model}"
            if self.served_model and _model_name(self.served_model) != _model_name(self.target_path)
            else ""
        )
        return f"{_kind(self.engine)}{version} on {self.target_path}{weights}{served}"


class OtherEngine(RuntimeError):
    """A run directory's responses were made by another engine or target than this run asks for: `reason` says what
    made them and what is asked now, `fix` the two ways on."""

    def __init__(self, reason: str, fix: str):
        self.reason, self.fix = reason, fix
        super().__init__(f"{reason}. {fix}")

    def __reduce__(self):  # Prefect pickles task exceptions into results
        return (OtherEngine, (self.reason, self.fix))


def declared_engine(launch: str, engine: str, command: list[str] | None = None) -> str | None:
    """The engine kind a config asks for, before any server answers: launch dev (or a command that runs the dev
    server) is the dev server; a launch command is server.engine; a running server (launch none) is not known until
    it says (`reported_engine`)."""
    if launch == "dev":
        return "dev"
    if launch == "command":
        words = command or []
        if any(w in ("emulators.dev_server", "serve-dev") for w in words):
            return "dev"
        if "emulators.sim" in words:
            return "sim"
        return engine
    return None


async def reported_engine(client: Any, engine: str) -> tuple[str, str | None, str | None] | None:
    """(kind, version, served model) as the server at `client` (an EngineClient of `engine`) says; None when it says
    nothing (down, a router that does not forward /server_info)."""
    info = await client.get_json("/server_info") or await client.get_json("/get_server_info")
    info = info if isinstance(info, dict) else {}
    version = info.get("version") if isinstance(info.get("version"), str) else None
    for suffix, kind in EMULATOR_VERSIONS.items():
        if version and version.endswith(suffix):
            return kind, version, _text(info.get("model_path"))
    if engine == "sglang":
        return ("sglang", version, _text(info.get("model_path"))) if version else None
    models = await client.get_json("/v1/models")
    served = models.get("data") if isinstance(models, dict) else None
    first = served[0] if isinstance(served, list) and served and isinstance(served[0], dict) else {}
    said = await client.get_json("/version")
    vllm_version = _text(said.get("version")) if isinstance(said, dict) else None
    if not first and vllm_version is None:
        return None
    return "vllm", vllm_version, _text(first.get("root")) or _text(first.get("id"))


def target_fingerprint(path: str) -> str | None:
    """sha256 over the target's config and tokenizer files and, per weights file, its size and SAMPLE_BYTES from its
    middle and its end; None when `path` is neither a directory here nor a Hub model in the local cache."""
    directory = _local_dir(path)
    if directory is None:
        return None
    digest = hashlib.sha256()
    for name in TARGET_FILES:
        file = directory / name
        if file.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(file.read_bytes())
    for file in sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            for offset in (max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def differences(recorded: Provenance, current: Provenance) -> list[str]:
    """What differs between the record and this run, in words; what either side does not know is not compared."""
    found = []
    if recorded.engine and current.engine and recorded.engine != current.engine:
        found.append(f"engine: {_kind(recorded.engine)}, now {_kind(current.engine)}")
    if recorded.target_fingerprint and current.target_fingerprint:
        same_target = recorded.target_fingerprint == current.target_fingerprint
    else:
        same_target = _same_path(recorded.target_path, current.target_path)
    if not same_target:
        found.append(f"target: {recorded.target_path}, now {current.target_path}")
    if (
        recorded.served_model
        and current.served_model
        and _model_name(recorded.served_model) != _model_name(current.served_model)
    ):
        found.append(f"served model: {recorded.served_model}, now {current.served_model}")
    return found


def read_record(layout: RunLayout) -> Provenance | None:
    """RUN_DIR/generated-by.json, or None where the run has none; DamagedFile when it cannot be read."""
    path = layout.generated_by
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        known = {f.name for f in fields(Provenance)}
        return Provenance(**{k: v for k, v in data.items() if k in known})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise DamagedFile(
            path,
            f"cannot read it: {exc}",
            "move it aside: the next generate adopts the run again, recording the engine and target it runs with",
        ) from None


def write_record(layout: RunLayout, current: Provenance, *, adopted: bool = False) -> None:
    """Write RUN_DIR/generated-by.json whole or not at all, with when, and whether an older run was adopted."""
    stamp = {"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "adopted": adopted}
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(layout.generated_by, json.dumps(asdict(current) | stamp, indent=2) + "\n")


def has_responses(layout: RunLayout) -> bool:
    """Some dataset of the run has responses on disk (a part, live or replaced: file names only, nothing read)."""
    root = layout.responses_root
    return root.is_dir() and any(d.is_dir() and list_parts(d) for d in root.iterdir())


def check_record(layout: RunLayout, current: Provenance, *, fallback: Provenance | None = None) -> Provenance | None:
    """The run's record, when it agrees with `current`; OtherEngine with the reason and what to do when the run
    has responses made otherwise (a record without responses binds nothing: the next generate replaces it).

    `fallback`: what made the responses of a run with no record, as far as something else says (`last_run_provenance`);
    a check before anything starts (the demo's) compares it too, since the stages overwrite RUN_DIR/config.yaml."""
    recorded = read_record(layout)
    source = layout.generated_by
    if recorded is None and fallback is not None and has_responses(layout):
        recorded, source = fallback, layout.config
    if recorded is None:
        return None
    found = differences(recorded, current)
    if found and has_responses(layout):
        raise refusal(layout, recorded, current, found, source)
    return recorded if source == layout.generated_by else None


def last_run_provenance(layout: RunLayout) -> Provenance | None:
    """What RUN_DIR/config.yaml (the config the last stage ran with) says generated the run: for a run written before
    generated-by.json, read before a stage overwrites it; None where it is missing or unreadable."""
    try:
        data = yaml.safe_load(layout.config.read_text(encoding="utf-8"))
        server, target = data["server"], data["target"]
        engine, launch = str(server.get("engine", "sglang")), str(server.get("launch", "none"))
        return Provenance(declared_engine(launch, engine, server.get("command")), str(target["path"]), launch=launch)
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None


def refusal(
    layout: RunLayout, recorded: Provenance, current: Provenance, found: list[str], source: Path
) -> OtherEngine:
    """The refusal: what the run was made with, what is asked now, what differs, and the two ways on."""
    e = recorded.engine
    how = ENGINE_KINDS[e][1] if e in ENGINE_KINDS else f"engine {e}" if e else "the engine it was made with"
    same = how + (f" and target.path: {recorded.target_path}" if any(f.startswith("target") for f in found) else "")
    return OtherEngine(
        f"{layout.run_dir} holds responses made by {recorded.describe()} ({_said_by(layout, source)}); this run asks "
        f"for {current.describe()} ({'; '.join(found)}): continuing would mix two engines' or models' responses in "
        "one run",
        "To use the new one, give a new run_dir (`eagle3 demo` gives each engine and target its own: "
        f"docs/commands.md); to continue this run, run it with {same}",
    )


def settle(layout: RunLayout, current: Provenance, logger: logging.Logger | logging.LoggerAdapter) -> Provenance:
    """Check `current` against the run's record (OtherEngine on a difference) and record it where the run has none
    yet: a run with responses and no record (written before records) is adopted, with a log line. Returns the
    provenance the run now has on record."""
    recorded = check_record(layout, current)
    if recorded is not None and not differences(recorded, current):
        if recorded.engine_version and current.engine_version and recorded.engine_version != current.engine_version:
            logger.info(
                "generated-by: %s %s, now %s: the same engine, resuming",
                _kind(current.engine),
                recorded.engine_version,
                current.engine_version,
            )
        return _filled(recorded, current)
    adopted = recorded is None and has_responses(layout)
    if adopted:
        logger.warning(
            "%s has responses from before runs recorded their engine: adopted as made by %s (%s); a later "
            "generate with another engine or target is refused",
            layout.run_dir,
            current.describe(),
            layout.generated_by,
        )
    elif recorded is not None:  # a record with no responses behind it: this run's engine makes the first ones
        logger.info(
            "generated-by: %s had no responses from %s; recording %s",
            layout.run_dir,
            recorded.describe(),
            current.describe(),
        )
    else:
        logger.info("generated-by: %s's responses are made by %s", layout.run_dir, current.describe())
    write_record(layout, current, adopted=adopted)
    return current


def _said_by(layout: RunLayout, source: Path) -> str:
    if source == layout.generated_by:
        return str(source)
    return f"as {source} says: the run is older than {layout.generated_by.name}"


def _filled(recorded: Provenance, current: Provenance) -> Provenance:
    """The record, with what it did not know taken from `current` (written back only by a new record)."""
    return replace(
        recorded,
        **{f.name: getattr(current, f.name) for f in fields(Provenance) if getattr(recorded, f.name) is None},
    )


def _kind(engine: str | None) -> str:
    """The engine kind in words ("a real vLLM"); one this code does not know by its name."""
    if engine is None:
        return "an engine not known yet"
    return ENGINE_KINDS[engine][0] if engine in ENGINE_KINDS else f"engine {engine}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _model_name(model: str) -> str:
    """The last component of a model's path or Hub id: /models/Kimi-K2.5 and moonshotai/Kimi-K2.5 are one model."""
    return model.rstrip("/").rsplit("/", 1)[-1]


def _same_path(a: str, b: str) -> bool:
    return a == b or Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def _local_dir(path: str) -> Path | None:
    """`path` as a directory here: itself, or a Hub id's snapshot in the local cache (nothing is downloaded)."""
    if Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(path, "config.json")
    except Exception:  # noqa: BLE001 - not a Hub id (a path that is not there): nothing to fingerprint
        return None
    return Path(found).parent if isinstance(found, str) else None
