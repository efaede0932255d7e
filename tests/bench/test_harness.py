"""bench/harness.py's table renderers: the one aligned-text and one markdown implementation the benches print with."""

from __future__ import annotations

import pytest

from bench import harness

HEAD = ("run", "tok/s", "notes")
ROWS = [("ours, 1 rank", "1,234", ""), ("baseline", "99", "median step 12 ms")]


def test_table_aligns_the_first_column_left_and_the_others_right(capsys: pytest.CaptureFixture[str]) -> None:
    harness.table(HEAD, ROWS)
    assert capsys.readouterr().out == (
        "   run           tok/s              notes\n"
        "   ------------  -----  -----------------\n"
        "   ours, 1 rank  1,234                   \n"
        "   baseline         99  median step 12 ms\n"
    )


def test_markdown_table_pads_its_columns_for_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    harness.markdown_table(HEAD, ROWS)
    assert capsys.readouterr().out == (
        "| run          | tok/s | notes             |\n"
        "|--------------|-------|-------------------|\n"
        "| ours, 1 rank | 1,234 |                   |\n"
        "| baseline     | 99    | median step 12 ms |\n"
    )


def test_markdown_table_with_align_is_a_docs_table(capsys: pytest.CaptureFixture[str]) -> None:
    harness.markdown_table(HEAD, ROWS, align="lrl")
    assert capsys.readouterr().out == (
        "| run | tok/s | notes |\n"
        "| --- | ---: | --- |\n"
        "| ours, 1 rank | 1,234 |  |\n"
        "| baseline | 99 | median step 12 ms |\n"
    )
    with pytest.raises(ValueError, match="one letter per column"):
        harness.markdown_table(HEAD, ROWS, align="lr")
