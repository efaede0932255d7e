"""A small capture job for the tests that launch real capture ranks: 8 short records on a random-weight tiny target."""

from __future__ import annotations

import random
from pathlib import Path

from settings.target import Target


def small_capture_job(tmp_path: Path) -> tuple[Path, Path]:
    """(the target, the capture job's JSON) in `tmp_path`: a random-weight tiny Llama (seconds to build) and 8 records
    of 12-40 tokens, the loss on all but their first 2-8; the shards go to tmp_path/hidden."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models.common.job_files import CaptureJobFile, DatasetRecords
    from models.target.tiny import build_tiny_target
    from tasks.records.build import RECORD_SCHEMA
    from tasks.runtime.launch_ranks import write_job

    target = build_tiny_target(
        tmp_path / "target",
        train_steps=0,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        vocab_size=512,
    )
    rng = random.Random(0)
    rows = []
    for i in range(8):
        n, prompt = rng.randint(12, 40), rng.randint(2, 8)
        rows.append(
            {
                "id": f"r{i}",
                "input_ids": [rng.randrange(8, 400) for _ in range(n)],
                "loss_mask": [0] * prompt + [1] * (n - prompt),
                "num_tokens": n,
                "num_loss_tokens": n - prompt,
                "truncated": False,
            }
        )
    (tmp_path / "records").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA), tmp_path / "records" / "part-000000.parquet")
    job = CaptureJobFile(
        target=Target(path=str(target)),
        datasets=[DatasetRecords(name="d", records_dir=str(tmp_path / "records"))],
        out_dir=str(tmp_path / "hidden"),
        device="cpu",
        mode="replicate",
        launch_tokens=None,
    )
    path = tmp_path / "capture.json"
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    return Path(target), path
