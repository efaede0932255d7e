"""The vLLM-backend capture in a child process that stops after its first shard, for the kill -9 test.

    python tests/tasks/capture/vllm_held.py JOB.json SHARED_DIR

Serves the dev server's vLLM emulation in process (the tiny target of the job, writing to
SHARED_DIR), captures through it, and after writing its first shard waits (bounded) for
`<out_dir>/.release`, which the test never creates: it sees the shard and SIGKILLs this process
while it certainly holds samples and requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

from emulators.dev_server.app import create_app
from emulators.vllm_extract import Extraction
from models.capture.vllm_hidden import extraction_config
from models.common.job_files import CaptureJobFile
from settings.capture import VllmCaptureSettings
from tasks.capture.vllm_capture import capture_with_vllm
from tests.models.capture.capture_held import hold_after_first_shard


def main(job_path: str, shared: str) -> None:
    job = CaptureJobFile.load(job_path)
    speculative, kv = extraction_config([1, 3, 4], 8, shared)
    app = create_app(job.target.path, extraction=Extraction.from_flags(json.dumps(speculative), json.dumps(kv)))
    hold_after_first_shard()
    engine = VllmCaptureSettings(url="http://vllm.test", max_concurrency=4)
    asyncio.run(capture_with_vllm(job, engine, Path(shared), transport=httpx.ASGITransport(app=app)))


if __name__ == "__main__":
    main(*sys.argv[1:])
