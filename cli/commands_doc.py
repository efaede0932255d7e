"""`make commands-doc`: write docs/commands.md, every `eagle3` command and option, from the CLI's own help.

The page is generated, never edited: each command's docstring and each option's `help=` in cli/app.py are the text,
so the page and `eagle3 COMMAND --help` cannot part ways (tests/cli/test_commands_doc.py fails when the page is not
current: then run this command). `serve-dev` passes its flags to the dev server, whose own `--help` is quoted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer.main
from typer.testing import CliRunner

from cli.app import app

PAGE = Path(__file__).resolve().parents[1] / "docs" / "commands.md"

INTRO = """\
# Commands: every `eagle3` command and its options

Generated from the CLI's own help by `make commands-doc` (cli/commands_doc.py): edit the help in cli/app.py,
not this page. `eagle3` is the console script of this project, in `.venv/bin` after `make demo` or `make test`.

Every command that writes a run directory (`run`, `generate`, `eval`, `demo`, `import-jsonl`, and every stage
flow and deployment) holds the lock on `RUN_DIR/.lock` while it runs; a second writer is refused at once, naming
the first ([operate-and-recover.md](operate-and-recover.md#one-writer-per-run-directory)). `stats`, `plan` and
`validate` only read.
"""


# typer 0.29 carries its own copy of click (typer._click): parameters are told apart by their kind's name
ARGUMENT, OPTION = "argument", "option"


def usage(name: str, command: Any) -> str:
    """`eagle3 NAME ARG... [OPTIONS]`, arguments in capitals."""
    args = [(p.name or "").upper() for p in command.params if p.param_type_name == ARGUMENT]
    options = any(p.param_type_name == OPTION for p in command.params)
    return " ".join(["eagle3", name, *args, *(["[OPTIONS]"] if options else [])])


def param_line(param: Any) -> str:
    """One bullet: the argument or option, its value, default and help."""
    help_text = " ".join((getattr(param, "help", None) or "").split())
    if param.param_type_name == ARGUMENT:
        return f"- `{(param.name or '').upper()}`: {help_text}"
    flag = ", ".join(param.opts)
    if not param.is_flag:
        flag += f" {param.metavar or (param.name or '').upper()}"
    notes = []
    if param.required:
        notes.append("required")
    elif not param.is_flag and param.default not in (None, ""):
        notes.append(f"default `{param.default}`")
    return f"- `{flag}`" + (f" ({', '.join(notes)})" if notes else "") + f": {help_text}"


def section(name: str, command: Any) -> str:
    """The command's heading, usage, help text and one bullet per parameter."""
    lines = [f"## `eagle3 {name}`", "", f"    {usage(name, command)}", "", (command.help or "").strip(), ""]
    params = [p for p in command.params if getattr(p, "help", None) is not None or p.param_type_name == ARGUMENT]
    lines += [param_line(p) for p in params]
    if name == "serve-dev":  # its flags are the dev server's own
        shown = CliRunner().invoke(app, ["serve-dev", "--help"], env={"COLUMNS": "100"}).output.rstrip()
        lines += ["```text", shown, "```"]
    return "\n".join(lines).rstrip() + "\n"


def page() -> str:
    """The whole page, commands in the order `eagle3 --help` lists them."""
    group: Any = typer.main.get_command(app)
    return "\n".join([INTRO, *(section(name, c) for name, c in group.commands.items())])


def main() -> int:
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
