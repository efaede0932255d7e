"""The heartbeat (tasks/runtime/heartbeat.py): a status line after each ~10 s of silence, on a fake clock."""

from __future__ import annotations

import threading

from tasks.runtime.heartbeat import Heartbeat


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_status_line_comes_after_each_10_s_of_silence_and_a_logged_line_restarts_the_silence():
    clock, logged = Clock(), []
    beat = Heartbeat(logged.append, clock=clock)
    beat.doing("waiting for the server")
    clock.now += 9.9
    assert beat.due() is None
    clock.now += 0.1
    assert beat.due() == "waiting for the server: 10 s so far"
    assert beat.due() is None  # a line returned counts as logged: the next one 10 s later
    clock.now += 5
    beat.log("the task's own line")  # logged, and the silence starts again
    clock.now += 9
    assert beat.due() is None
    clock.now += 1
    assert beat.due() == "waiting for the server: 25 s so far"  # seconds since the step began, not since the line
    assert logged == ["the task's own line"]


def test_a_new_step_counts_its_own_seconds_and_no_step_means_no_line():
    clock, counts = Clock(), {"done": 0}
    beat = Heartbeat(lambda line: None, clock=clock)
    clock.now += 30
    assert beat.due() is None  # nothing under way: nothing to say
    beat.doing(lambda seconds: f"{counts['done']}/100 prompts, {seconds:.0f} s")
    clock.now += 10
    counts["done"] = 40
    assert beat.due() == "40/100 prompts, 10 s"
    beat.doing(None)
    clock.now += 60
    assert beat.due() is None


def test_the_thread_logs_the_due_line_and_stops_with_the_context():
    clock, lines, seen = Clock(), [], threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        seen.set()

    with Heartbeat(log, clock=clock, poll_s=0.01) as beat:
        beat.doing("loading")
        clock.now += 12
        assert seen.wait(30), "no heartbeat line within 30 s"
    assert lines == ["loading: 12 s so far"]
    assert not any(t.name == "heartbeat" for t in threading.enumerate())  # the context stopped it
