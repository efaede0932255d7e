"""docs/commands.md is the CLI's own help (cli/commands_doc.py), current, and names every command and option."""

from __future__ import annotations

from pathlib import Path

import typer.main

from cli.app import app
from cli.commands_doc import PAGE, page

REPO = Path(__file__).resolve().parents[2]


def test_the_page_is_current():
    assert PAGE == REPO / "docs" / "commands.md"
    assert PAGE.read_text() == page(), "docs/commands.md is out of date: run `make commands-doc`"


def test_every_command_and_option_is_on_the_page_with_its_help():
    text = PAGE.read_text()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert f"## `eagle3 {name}`" in text
        for param in command.params:
            if param.param_type_name == "option" and param.help:
                assert f"`{param.opts[0]}" in text and " ".join(param.help.split())[:60] in text, (name, param.opts)
    # the dev server's flags, from its own --help (emulators/dev_server/cli.py)
    assert "--speculative-draft-model-path" in text and "--sglang-version {0.5,0.4}" in text
