"""deploy/vllm-plugins/eagle3_hidden_states.py, the parts that are ours, in vLLM's own venv (the module imports vLLM).

- the rows it reads equal a plain loop over vLLM's paged layout (`basic_cache` in vllm/model_executor/models/
  extract_hidden_states.py: slot s at [s // block_size, :, s % block_size]), blocks in any order, the last block
  partly filled;
- a write that fails (the disk full) leaves neither the file nor its .tmp, and releases the lock.
The connector inside a running vLLM: tests/tasks/serving/test_vllm_capture_real.py. Without .venv-vllm these skip.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PLUGINS = REPO / "deploy" / "vllm-plugins"

pytestmark = [pytest.mark.vllm]

CHECKS = textwrap.dedent(
    """
    import fcntl, os, sys
    import torch
    sys.path.insert(0, sys.argv[1])
    import eagle3_hidden_states as c

    # a paged cache [blocks, ids, block_size, H] filled as vLLM's basic_cache fills it, for one request's tokens
    blocks, ids, block_size, hidden = 9, 4, 16, 8
    cache = torch.zeros(blocks, ids, block_size, hidden)
    block_ids = [7, 2, 5]  # the request's blocks, in its order
    tokens = 37  # the last block partly filled
    rows = torch.randn(tokens, ids, hidden)
    for t in range(tokens):
        b, o = block_ids[t // block_size], t % block_size
        cache[b, :, o] = rows[t]
    got = c.gather_rows(cache, c.slot_rows(block_ids, block_size, tokens))
    assert got.shape == (tokens, ids, hidden), got.shape
    assert torch.equal(got, rows), (got - rows).abs().max()
    got[0, 0, 0] = 1e9  # a copy: the blocks may be reused once it is made
    assert cache[7, 0, 0, 0] != 1e9
    # the wrong order of blocks reads other rows: the check can fail
    assert not torch.equal(c.gather_rows(cache, c.slot_rows([2, 7, 5], block_size, tokens)), rows)

    # a failed write: no file, no .tmp, the lock released
    out = os.path.join(sys.argv[2], "r.safetensors")
    fd = os.open(out + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    def full(tensors, path):
        open(path, "wb").write(b"partial")
        raise OSError(28, "No space left on device")
    c.save_file = full
    try:
        c.write_file({"hidden_states": rows, "token_ids": torch.arange(tokens)}, out, None, fd)
        raise SystemExit("no error")
    except OSError:
        pass
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp"), os.listdir(sys.argv[2])
    probe = os.open(out + ".lock", os.O_RDONLY)
    fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: a reader does not wait for a file that never comes
    print("ok")
    """
)


def test_the_connector_reads_the_paged_rows_and_leaves_nothing_of_a_failed_write(tmp_path):
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no real vLLM: {VLLM_PYTHON} is missing (`make vllm` installs it; CI does)")
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-c", CHECKS, str(PLUGINS), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
