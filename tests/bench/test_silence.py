"""bench/silence.py: each output line timed, a redraw counted as a line, the longest gap found between its lines."""

from __future__ import annotations

import io

import pytest

from bench.silence import gaps, report, timed_lines


@pytest.mark.multiprocess
def test_the_longest_gap_is_found_between_the_lines_around_it():
    command = ["bash", "-c", "echo first; sleep 0.6; printf 'bar 50%%\\rbar 100%%\\n'; echo done >&2; exit 3"]
    lines, ended, code = timed_lines(command)
    assert code == 3 and [text for _, text in lines] == ["first", "bar 50%", "bar 100%", "done"]
    gap, at, before, after = gaps(lines, ended)[0]
    assert gap >= 0.6 and (before, after) == ("first", "bar 50%") and at == lines[0][0]
    out = io.StringIO()
    report(lines, ended, 1, out)
    assert out.getvalue().startswith(f"\n4 lines in {ended:.1f} s; the longest silences:\n  {gap:6.1f} s after")
