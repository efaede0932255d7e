"""The tiny kimi_k25 checkpoint's processor (models/target/kimi_k25_remote/, our own code to Kimi-K2.5's published
interface), checked against independent sources:
- vLLM 0.32's own Kimi-K2.5 image processor (transformers_utils/processors/kimi_k25_vision_fused.py, run in
  .venv-vllm): the same token count, grid and pixel values for images of several shapes;
- transformers' AutoProcessor under trust_remote_code, in our venv and in SGLang's (transformers 5.19), finds it
  through preprocessor_config.json's auto_map, with the `media_processor` SGLang 0.5.23 reads;
- a media_proc_cfg without a key the engines read, and a video chunk, are refused, saying what is wrong.

Without .venv-vllm / .venv-sglang the comparisons with them skip, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.target.kimi_k25_remote.kimi_k25_vision_processing import KimiK25VisionProcessor
from models.target.tiny_kimi import MEDIA_PROC_CFG, PROCESSOR_AUTO_MAP, PROCESSOR_FILES, REMOTE_CODE_DIR

REPO = Path(__file__).resolve().parents[3]
SIZES = [(90, 60), (1, 1), (3000, 20), (500, 517), (28, 28)]  # width x height: small, a pixel, a strip, > one side


def images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for w, h in SIZES]


def ours() -> dict[str, list]:
    processor = KimiK25VisionProcessor.from_dict({"media_proc_cfg": MEDIA_PROC_CFG})
    medias = [{"type": "image", "image": image} for image in images()]
    out = processor.preprocess(medias)
    return {
        "tokens": [processor.media_tokens_calculator(m) for m in medias],
        "grid_thws": out["grid_thws"].tolist(),
        "pixel_values": out["pixel_values"],
    }


VLLM_SCRIPT = """
import json, sys
import numpy as np
from PIL import Image
from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor
cfg, sizes, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB") for w, h in sizes]
p = KimiK25FusedVisionProcessor.from_dict({"media_proc_cfg": cfg})
medias = [{"type": "image", "image": i} for i in imgs]
r = p.preprocess(medias)
np.savez(out, tokens=np.array([p.media_tokens_calculator(m) for m in medias]), grid_thws=r["grid_thws"].numpy(),
         pixel_values=r["pixel_values"].numpy())
"""


def test_images_are_cut_as_vllm_s_own_kimi_processor_cuts_them(tmp_path):
    python = REPO / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no real vLLM: {python} is missing (`make vllm`; CI makes it)")
    out = tmp_path / "vllm.npz"
    args = [str(python), "-c", VLLM_SCRIPT, json.dumps(MEDIA_PROC_CFG), json.dumps(SIZES), str(out)]
    subprocess.run(args, check=True, capture_output=True, timeout=300)
    theirs, mine = np.load(out), ours()
    assert mine["tokens"] == theirs["tokens"].tolist() == [12, 1, 108, 342, 1]  # 3000x20: 108 x 1 merged patches
    assert mine["grid_thws"] == theirs["grid_thws"].tolist()
    assert mine["pixel_values"].shape == theirs["pixel_values"].shape
    np.testing.assert_allclose(mine["pixel_values"], theirs["pixel_values"], rtol=0, atol=1e-6)


def checkpoint_without_weights(tiny_target_dir: Path, out: Path) -> Path:
    """The tiny Llama target's tokenizer with the kimi processor's files and preprocessor_config.json, as
    models/target/tiny_kimi.py writes them (the processor reads no weights)."""
    shutil.copytree(tiny_target_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in PROCESSOR_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, out / name)
    preprocessor = {"auto_map": PROCESSOR_AUTO_MAP, "media_proc_cfg": MEDIA_PROC_CFG}
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out


LOAD_SCRIPT = """
import sys
from transformers import AutoProcessor
p = AutoProcessor.from_pretrained(sys.argv[1], trust_remote_code=True)
print(type(p).__name__, type(p.media_processor).__name__, p.media_processor.media_proc_cfg["patch_size"],
      p(text=["hello"])["input_ids"] == [p.tokenizer("hello", add_special_tokens=False)["input_ids"]])
"""


@pytest.mark.parametrize("venv", [".venv", ".venv-sglang"])
def test_auto_processor_finds_the_remote_processor_with_sglang_s_media_processor(tiny_target_dir, tmp_path, venv):
    python = REPO / venv / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"{python} is missing (`make sglang`; CI makes it)")
    target = checkpoint_without_weights(tiny_target_dir, tmp_path / "kimi")
    done = subprocess.run([str(python), "-c", LOAD_SCRIPT, str(target)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["KimiK25Processor", "KimiK25VisionProcessor", "14", "True"]


def test_a_config_missing_a_key_and_a_video_are_refused_saying_what():
    cfg = {k: v for k, v in MEDIA_PROC_CFG.items() if k != "patch_size"}
    with pytest.raises(KeyError, match="media_proc_cfg has no 'patch_size'"):
        KimiK25VisionProcessor.from_dict({"media_proc_cfg": cfg})
    with pytest.raises(KeyError, match="has no media_proc_cfg"):
        KimiK25VisionProcessor.from_dict({"patch_size": 14})
    processor = KimiK25VisionProcessor.from_dict({"media_proc_cfg": MEDIA_PROC_CFG})
    with pytest.raises(ValueError, match="images only, not 'video_chunk'"):
        processor.media_tokens_calculator({"type": "video_chunk", "video_chunk": []})


def test_an_edit_to_the_remote_code_changes_the_kimi_build_info(tmp_path, monkeypatch):
    """The build info holds a digest of the remote code a kimi build copies, so a checkpoint built before an edit is
    rebuilt rather than shipping the old copy; the package's own __init__ is not copied and does not count."""
    from models.target import tiny_kimi

    before = tiny_kimi.remote_code_digest()
    copy = tmp_path / "remote"
    shutil.copytree(REMOTE_CODE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(tiny_kimi, "REMOTE_CODE_DIR", copy)
    assert tiny_kimi.remote_code_digest() == before
    (copy / "__init__.py").write_text('"""edited"""\n')
    assert tiny_kimi.remote_code_digest() == before
    (copy / "media_utils.py").write_text((copy / "media_utils.py").read_text() + "\n# edited\n")
    assert tiny_kimi.remote_code_digest() != before
