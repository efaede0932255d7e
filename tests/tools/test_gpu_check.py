"""tools/gpu_check.py: its --cpu-smoke run takes the GPU check's path end to end and reports every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The GPU machine has no Prefect (docs/gpu-check.md): the check process must not import it, even lazily. httpx is
# there (huggingface_hub 1.x needs it, and transformers 5.17 imports it at `import transformers`; huggingface_hub 2.x
# moved to httpx2), so httpx is refused only to the project's own modules, whether or not transformers loaded it first.
WITHOUT_PREFECT = """
import builtins, importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prefect":
            raise ImportError(f"{name} is not on the GPU machine")
sys.meta_path.insert(0, Refuse())
OURS = {"__main__", "bench", "deploy", "emulators", "flows", "models", "tasks", "tools"}
real_import = builtins.__import__
def ours_without_httpx(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] == "httpx" and (globals or {}).get("__name__", "").split(".")[0] in OURS:
        raise ImportError(f"{name}: the check's own modules must not need it on the GPU machine")
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = ours_without_httpx
sys.argv = ["tools/gpu_check.py", *sys.argv[1:]]
runpy.run_path("tools/gpu_check.py", run_name="__main__")
"""


def cpu_smoke(script: str, out: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """`gpu_check --cpu-smoke --json OUT` run by `script` (gpu_check under an import guard), its output captured."""
    command = [sys.executable, "-c", script, "--cpu-smoke", "--json", str(out)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_smoke_runs_every_phase_and_reports_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = cpu_smoke(WITHOUT_PREFECT, out, timeout_s=480)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    figures = json.loads(out.read_text())
    phases = figures["phases"]
    assert figures["ok"] is True and list(phases) == ["target", "records", "capture", "train", "export", "eval"]
    assert all(p["ok"] and p["wall_s"] >= 0 for p in phases.values())
    assert phases["records"]["records"] == 24 and phases["records"]["generate_tokens_per_s"] > 0
    capture, train = phases["capture"], phases["train"]
    assert capture["tokens"] == phases["records"]["tokens"]  # every record ends with a loss token: nothing trimmed
    assert capture["tokens_per_s"] > 0 and capture["stored_gb"] > 0 and capture["host_peak_rss_gib"] > 0
    assert train["steps"] == 6 and train["steps_per_s"] > 0 and train["tokens_per_s"] > 0
    assert math.isfinite(train["first_loss"]) and math.isfinite(train["final_loss"]) and train["host_peak_rss_gib"] > 0
    assert "gpu_peak_allocated_gib" not in train  # no CUDA on this machine
    assert phases["export"]["export_mb"] > 0 and phases["export"]["draft_vocab_size"] > 0
    assert phases["eval"]["acceptance_length"] >= 1 and phases["eval"]["untrained_acceptance_length"] >= 1
    assert figures["machine"]["deepspeed"] and figures["machine"]["cuda_available"] is False
    assert (tmp_path / "gpu_check.log").read_text().count("RANK_MEMORY") == 3  # capture, train, eval
    assert "every phase passed" in proc.stdout


# The eval job as the check launches it, but held for good after its 2nd prompt's line: the check's eval limit
# (--eval-s) is then certainly what ends it, with exactly 2 prompts measured. The check process swaps it in for
# `python -m models.eval` through tasks.runtime.launch_ranks.follow_job, which Check.launch imports when it launches.
HELD_EVAL = """
import sys, threading
from models.eval import job as eval_job
from models.common.rank_protocol import EVAL_PROGRESS
say = eval_job.say
def held(line):
    say(line)
    if (EVAL_PROGRESS.parse(line) or {}).get("done") == 2:
        threading.Event().wait(600)  # never set: the check kills this process at its limit
eval_job.say = held
sys.exit(eval_job.main())
"""
WITH_HELD_EVAL = WITHOUT_PREFECT.replace(
    "sys.argv = ",
    f"""
import tasks.runtime.launch_ranks
follow_job = tasks.runtime.launch_ranks.follow_job
def held_eval(command, **kw):
    if "models.eval" in command:
        at = command.index("models.eval")
        command = [*command[:at - 1], "-c", {HELD_EVAL!r}, *command[at + 1:]]
    return follow_job(command, **kw)
tasks.runtime.launch_ranks.follow_job = held_eval
sys.argv = """,
    1,
)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_eval_past_its_limit_leaves_its_per_prompt_figures(tmp_path):
    """The eval, the tightest phase, killed at its limit: the JSON keeps each prompt measured and the acceptance so far.

    Run with the GPU run's launcher (`--rank-launcher deepspeed`): capture and ZeRO-2 training through
    deepspeed.launcher.runner, on CPU ranks.
    """
    import time

    out, console = tmp_path / "gpu_check.json", tmp_path / "console.txt"
    with open(console, "w") as sink:
        check = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WITH_HELD_EVAL,
                "--cpu-smoke",
                "--rank-launcher",
                "deepspeed",
                "--eval-prompts",
                "4",
                "--eval-s",
                "30",
                "--json",
                str(out),
            ],
            cwd=REPO,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        try:
            # in the JSON as they come: the 2nd prompt's figures while the eval is still running (held)
            deadline, running = time.monotonic() + 300, {}
            while running.get("prompts_done") != {"trained": 2}:
                assert check.poll() is None and time.monotonic() < deadline, console.read_text()[-4000:]
                time.sleep(0.1)  # polling the JSON the check rewrites, bounded by the deadline
                running = json.loads(out.read_text())["phases"].get("eval", {}) if out.exists() else {}
            assert running["running"] is True and running["ok"] is False and running["wall_s"] < 30
            assert [x["prompt"] for x in running["per_prompt"]["trained"]] == [1, 2]
            check.wait(timeout=120)
        finally:
            if check.poll() is None:
                check.kill()
    stdout = console.read_text()
    assert check.returncode == 1, stdout[-4000:]
    figures = json.loads(out.read_text())
    phases = figures["phases"]
    assert figures["ok"] is False and all(phases[name]["ok"] for name in ("capture", "train", "export"))
    log = (tmp_path / "gpu_check.log").read_text()
    assert log.count("launch: " + sys.executable + " -m deepspeed.launcher.runner --num_gpus 1 ") == 2
    assert "WORLD INFO DICT: {'localhost': [0]}" in log

    evaluation = phases["eval"]
    assert evaluation["ok"] is False and evaluation["timed_out"] is True and "running" not in evaluation
    assert evaluation["error"].startswith("JobTimedOut: job killed after its time limit of 30 s")
    assert evaluation["wall_s"] >= 30
    assert evaluation["prompts"] == 4 and evaluation["prompts_done"] == {"trained": 2}  # the trained draft first
    trained = evaluation["per_prompt"]["trained"]
    assert [x["prompt"] for x in trained] == [1, 2] and list(evaluation["per_prompt"]) == ["trained"]
    for x in (
        trained
    ):  # each round adds accepted + 1 tokens, the prefill the first one (models/eval/speculative_decoding.py)
        assert 1 <= x["new_tokens"] <= 12 and x["new_tokens"] - 1 == x["rounds"] + x["accepted"]
        assert 0 <= x["accepted"] <= 3 * x["rounds"]
    rounds = sum(x["rounds"] for x in trained)
    assert evaluation["rounds"] == rounds and evaluation["new_tokens"] == sum(x["new_tokens"] for x in trained)
    assert evaluation["acceptance_length"] == round((sum(x["accepted"] for x in trained) + rounds) / rounds, 4)
    assert evaluation["untrained_acceptance_length"] is None
    assert evaluation["per_prompt"] == running["per_prompt"]  # what it had when it was killed
    assert (
        "TIMED OUT after" in stdout
        and f"{evaluation['acceptance_length']:.3f} / - (partial: trained 2 of 4 prompts)" in stdout
    )


@pytest.mark.multiprocess
def test_a_missing_deepspeed_stops_the_check_before_its_first_phase(tmp_path):
    """On the GPU machine a package that is not there must cost seconds, not the slot: no phase runs."""
    out = tmp_path / "gpu_check.json"
    # absent as an uninstalled package is: `import deepspeed` fails, importlib.util.find_spec says None
    hidden = WITHOUT_PREFECT.replace(
        "sys.meta_path.insert(0, Refuse())", "sys.meta_path.insert(0, Refuse())\nsys.modules['deepspeed'] = None"
    )
    proc = cpu_smoke(hidden, out, timeout_s=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped before its first phase: deepspeed failed" in proc.stdout and "== target" not in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["ok"] is False and figures["phases"] == {}
    [deepspeed] = [f for f in figures["preflight"] if f["name"] == "deepspeed"]
    assert deepspeed["status"] == "FAIL" and "import deepspeed failed: ModuleNotFoundError" in deepspeed["detail"]
    assert {f["name"]: f["status"] for f in figures["preflight"]}["torch"] in ("PASS", "WARN")  # WARN: another version


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_mid_train_leaves_no_rank_process(tmp_path, procs):
    """The device runner's timeout sends SIGTERM to the check alone; the ranks it launched (a session of their own)
    must die with it, or they hold the GPU after the slot."""
    import os
    import signal
    import time

    out = tmp_path / "gpu_check.json"
    check = subprocess.Popen(
        [sys.executable, "-u", "-c", WITHOUT_PREFECT, "--cpu-smoke", "--json", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: set[int] = set()
    try:
        for line in check.stdout:  # the phases as the check prints them
            if line.startswith("== train"):
                break
        deadline = time.monotonic() + 120
        while not any("models.train" in _cmdline(pid) for pid in procs.descendants(check.pid)):
            assert check.poll() is None and time.monotonic() < deadline, "no training rank started"
            time.sleep(0.1)
        seen = set(procs.descendants(check.pid))
        check.send_signal(signal.SIGTERM)
        check.wait(timeout=60)
    finally:
        if check.poll() is None:
            check.kill()
    deadline = time.monotonic() + 30
    while any(procs.alive(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in seen if procs.alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == [], "rank processes outlived the check"
    assert check.returncode != 0
    figures = json.loads(out.read_text())  # written on the way out, the train phase's failure in it
    assert figures["ok"] is False and figures["phases"]["capture"]["ok"] is True
    assert "terminated" in figures["phases"]["train"]["error"]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
