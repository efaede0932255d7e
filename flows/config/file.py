"""The run config as a file: YAML read and checked with every problem named (`ConfigError`), and saved as run.

`load_config` turns every problem into a `ConfigError` whose lines name the file, the key path
(`datasets[2].token_budget`) and what is expected, with "did you mean" for a misspelled key; the
schema itself is settings/run.py `RunConfig`.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from settings.run import RunConfig


class ConfigError(ValueError):
    """A config that cannot be used; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: invalid config ({len(problems)} problem(s)):\n{lines}")


def load_config(path: str | Path, base: Path | None = None) -> RunConfig:
    """Read, validate and resolve a YAML run config; raise ConfigError naming every problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), [f"no such file {str(path)!r} (give the path of a YAML run config)"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc})"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(path), [f"{where}YAML syntax error: {problem}"]) from None
    return parse_config(data, source=str(path), base=base if base is not None else Path.cwd())


def parse_config(data: Any, *, source: str = "<config>", base: Path | None = None) -> RunConfig:
    """Validate an already-parsed mapping; relative paths resolve against `base` (default cwd)."""
    if not isinstance(data, dict):
        raise ConfigError(
            source, [f"the top level must be a mapping of keys (run_dir, target, ...), got {type(data).__name__}"]
        )
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(err) for err in exc.errors()]) from None
    config = config.resolve_paths(base if base is not None else Path.cwd())
    problems = _directory_problems(config) + _node_problems(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def dump_config(config: RunConfig) -> str:
    """The config as YAML, the form saved as RUN_DIR/config.yaml."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_run_config(config: RunConfig) -> Path:
    """RUN_DIR/config.yaml: the config as run, paths resolved (names of secrets only, never values)."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    path = config.layout.config
    tmp = path.with_suffix(".yaml.tmp")
    try:
        tmp.write_text(dump_config(config))
        tmp.replace(path)
    except OSError as exc:  # the first write of every stage: a full disk shows here first
        tmp.unlink(missing_ok=True)
        from models.common.file_errors import WriteFailed

        raise WriteFailed(
            path,
            exc,
            kept="everything the run wrote before",
            resume="free space there, then run the same command again",
        ) from None
    return path


def _describe(err: ErrorDetails) -> str:
    """One line for one pydantic error: key path, what is wrong, what is expected."""
    loc = err["loc"]
    key = _key_path(loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        suggestion = f"did you mean {hint[0]!r}? " if hint else ""
        return f"{key}: unknown key; {suggestion}allowed keys here: {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    return f"{key or '<top level>'}: {message}{shown}"


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc` (for 'did you mean')."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        candidates = [annotation, *(inner or [])]
        section = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _directory_problems(config: RunConfig) -> list[str]:
    """One line per directory setting that names a file (or lies under one): it could never be created."""
    problems = []
    settings = {
        "run_dir": config.run_dir,
        "capture.out_dir": config.capture.out_dir,
        "capture.nvme_path": config.capture.nvme_path,
        "capture.engine.shared_dir": config.capture.engine.shared_dir,
        "train.out_dir": config.train.out_dir,
    }
    for key, path in settings.items():
        if path is None:
            continue
        existing = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
        if existing is None or existing.is_dir():
            continue
        if existing == path:
            problems.append(
                f"{key}: {path} exists and is not a directory; it must be a directory or absent"
                " (point it at a new or existing directory, or move the file away)"
            )
        else:
            problems.append(
                f"{key}: {path} cannot be a directory because {existing} is a file;"
                " it must be a directory or absent (point it elsewhere)"
            )
    return problems


def _node_problems(config: RunConfig) -> list[str]:
    """One line per stage whose launch cannot span distributed.nnodes nodes (a missing master_addr or hostfile, ...)."""
    if not config.distributed.multinode:
        return []
    from tasks.runtime.launch_ranks import node_problems, resolve_launcher

    found: dict[str, list[str]] = {}  # problem -> the stages that have it
    for name, stage in (("capture", config.capture), ("train", config.train)):
        launcher = resolve_launcher(stage.launcher)
        how = f"{name}: launcher {stage.launcher}" + (f" = {launcher} here" if stage.launcher == "auto" else "")
        for problem in node_problems(config.distributed, launcher, stage.num_gpus):
            found.setdefault(problem, []).append(how)
    return [f"distributed: {problem} ({'; '.join(stages)})" for problem, stages in found.items()]
