"""`make config-keys`: write docs/config-keys.md, every key a run config takes, from the schema itself.

Section by section (settings/run.py `RunConfig` and the sections it nests: `capture.engine`, `datasets[]`,
`eval.benchmarks[]`, ...), each key with its type, its default (or "required") and its description, which is the
docstring under the field (settings/base.py: pydantic's use_attribute_docstrings). A section's keys may be declared
across several classes of its module (the section and the job settings it shares with the jobs): the page shows them in
one place. Nothing reads the page; tests/settings/test_keys.py fails when it and the schema part ways: then run this
command instead of editing it.
"""

from __future__ import annotations

import enum
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from settings.run import RunConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-keys.md"
HEADER = """# Every config key

Generated from the schema (settings/run.py `RunConfig`) by `make config-keys`; do not edit by hand
(tests/settings/test_keys.py checks it is current). How a run config is put together, with examples:
[run-a-pipeline.md](run-a-pipeline.md). A key not listed here is an error, named with its file and line.
"""


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config sections an annotation holds: the model itself, or inside list[...] / X | None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in models_in(arg)]


def type_name(annotation: Any) -> str:
    """A reader's name for a type: `int`, `a | b` for a Literal, `list[str]`, `path`, `X | none`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin in (list, tuple, dict, set):
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if origin is not None:  # Annotated and other wrappers: the type they wrap
        return type_name(args[0]) if args else str(origin)
    if annotation is type(None):
        return "none"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    text = "null" if value is None else repr(value) if not isinstance(value, str) else value
    return f"`{text}`" if text != "" else '`""`'


def constraints(field: FieldInfo) -> str:
    """The bounds pydantic checks (ge, le, min_length, ...), as `>= 1`."""
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "length >=", "max_length": "length <="}
    found = []
    for meta in field.metadata:
        for name, sign in words.items():
            value = getattr(meta, name, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def cell(text: str) -> str:
    """One markdown table cell: whitespace collapsed, pipes escaped."""
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def sections(model: type[BaseModel], key: str) -> list[tuple[str, type[BaseModel]]]:
    """(dotted key, model) for `model` and every section nested in it, depth first."""
    found = [(key, model)]
    for name, field in model.model_fields.items():
        for inner in models_in(field.annotation):
            dotted = f"{key}.{name}" if key else name
            found += sections(inner, f"{dotted}[]" if get_origin(field.annotation) is list else dotted)
    return found


def section_table(key: str, model: type[BaseModel]) -> str:
    title = f"## `{key}`" if key else "## The top level"
    doc = cell((model.__doc__ or "").split("\n\n")[0])
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        kind = type_name(field.annotation)
        bounds = constraints(field)
        about = field.description or ""
        for inner in models_in(field.annotation):  # a nested section: its own table below says the rest
            about = about or cell((inner.__doc__ or "").split("\n\n")[0])
        rows.append(
            f"| `{name}` | {kind}{f' ({cell(bounds)})' if bounds else ''} | {cell(default_text(field))} "
            f"| {cell(about)} |"
        )
    return "\n".join([title, "", doc, "", *rows])


def page() -> str:
    """The whole page, as `make config-keys` writes it."""
    parts = [HEADER]
    seen: set[tuple[str, type]] = set()
    for key, model in sections(RunConfig, ""):
        if (key, model) not in seen:
            seen.add((key, model))
            parts.append(section_table(key, model))
    return "\n\n".join(parts) + "\n"


def main() -> int:
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
