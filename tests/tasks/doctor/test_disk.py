"""tasks/doctor/disk.py: a capture that cannot fit on a real small filesystem is a FAIL with the figures."""

from __future__ import annotations

from tasks.capture.plan import TargetShape, plan_capture
from tasks.doctor.disk import disk_findings

SHAPE = TargetShape(hidden_size=128, num_layers=8, dtype="float32")  # 4 x 128 x 4 B + ids = 2,056 B a token


def by_name(findings):
    return {f.name: f for f in findings}


def test_budgets_that_cannot_fit_before_any_record_fail(tmp_path, tmpfs):
    with tmpfs(tmp_path / "small", "1m") as small:
        plan = plan_capture([tmp_path / "records" / "B1"], small / "hidden", SHAPE, "auto", margin=0.05)
        f = by_name(disk_findings(plan, budget_tokens=10_000, run_dir=tmp_path / "run"))["disk: capture"]
        assert plan.tokens_total == 0 and f.status == "FAIL"
        assert f"10,000 completion tokens alone need 19.6 MiB ({plan.bytes_per_token:,} B a token" in f.detail
        assert "1,024.0 KiB free" in f.detail or "1.0 MiB free" in f.detail
        ok = by_name(disk_findings(plan, budget_tokens=100, run_dir=tmp_path / "run"))["disk: capture"]
        assert ok.status == "PASS"


def test_a_nearly_full_run_directory_warns(tmp_path, tmpfs):
    with tmpfs(tmp_path / "run", "1m") as run:
        plan = plan_capture([], tmp_path / "hidden", SHAPE, "auto", margin=0.05)
        f = by_name(disk_findings(plan, budget_tokens=0, run_dir=run))["disk: run directory"]
        assert f.status == "WARN" and str(run) in f.detail
