#!/usr/bin/env bash
# A real SGLang 0.5.23 server for a CPU, in a venv of its own: `deploy/sglang-cpu/install.sh VENV` (`make sglang`
# runs it for .venv-sglang). What is real: the unmodified sglang 0.5.23 package (HTTP server, tokenizer manager,
# scheduler, radix cache, model code). What is a STAND-IN, labelled wherever it appears:
#   - sgl_kernel: the sglang-kernel 0.4.10 wheel's Python files, its CUDA .so files left out, and a common_ops of
#     our own (sgl_kernel_common_ops.py says why) that registers our torch implementations of SGLang's CPU
#     speculative-decoding, KV-cache and intel_amx attention ops (sgl_kernel_speculative_ops.py,
#     sgl_kernel_kvcache_ops.py, sgl_kernel_attention_ops.py); no other
#     SGLang kernel op exists, and a call to one fails loudly.
#   - torchvision 0.28.0 without its C++ ops, plus two op schemas it needs at import (torchvision_ops.py).
#   - an SGLang plugin (SGLang's own entry-point mechanism) that keeps `--attention-backend intel_amx` on a CPU
#     without AMX, whose two attention ops are ours (sglang_plugin_intel_amx_attention.py says why and what else);
#   - one that answers torch.cuda.synchronize on a CPU build of torch, which SGLang's MLA EAGLE-3 draft calls
#     (sglang_plugin_cpu_device_sync.py).
# A GPU machine installs SGLang its own way (`pip install sglang==0.5.23`, docs/engines.md), not with this.
# Times on this project's 2-core CI machine: 1-2 minutes with uv (deploy/pip-install.sh), 3.3 GB.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:?usage: install.sh VENV}"
py="${PY:-python3}"
SGLANG=sglang==0.5.23
KERNEL=sglang-kernel==0.4.10
TORCHVISION=torchvision==0.28.0

test -d "$venv" || "$py" -m venv "$venv"
pip=("$here/../pip-install.sh" "$venv" -q --no-warn-conflicts)  # uv when it can be had: deploy/pip-install.sh
"$venv/bin/pip" install -q --upgrade pip
# The local CPU torch first: sglang's metadata pins a CUDA torch 2.14.1, so sglang itself goes in with --no-deps.
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps "$SGLANG"
"${pip[@]}" -c "$here/constraints.txt" -r "$here/requirements.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# Stand-in 1: sgl_kernel = the wheel's .py files + our common_ops and the op files it loads (no .so is extracted).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/pip" download -q --no-deps "$KERNEL" -d "$work"
rm -rf "$site/sgl_kernel"
"$venv/bin/python" - "$work"/sglang_kernel-*.whl "$site" <<'PY'
import sys, zipfile
wheel, site = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("sgl_kernel/") and n.endswith(".py")]
    z.extractall(site, names)
print(f"sgl_kernel: {len(names)} Python files from {wheel.rsplit('/', 1)[-1]}, no .so")
PY
mkdir -p "$site/sgl_kernel/sm100"
cp "$here/sgl_kernel_common_ops.py" "$site/sgl_kernel/sm100/common_ops.py"
cp "$here/sgl_kernel_speculative_ops.py" "$here/sgl_kernel_kvcache_ops.py" "$here/sgl_kernel_attention_ops.py" \
  "$site/sgl_kernel/sm100/"

# Stand-in 2: torchvision's Python without its CUDA-built ops, and the two schemas its import needs.
"${pip[@]}" --no-deps "$TORCHVISION"
cp "$here/torchvision_ops.py" "$site/eagle3_torchvision_ops.py"
echo "import eagle3_torchvision_ops; eagle3_torchvision_ops.install()" > "$site/eagle3_torchvision_ops.pth"

# Stand-in 3: the plugins, as an installed distribution with entry points in SGLang's plugin group.
cp "$here/sglang_plugin_intel_amx_attention.py" "$site/eagle3_sglang_plugin_intel_amx_attention.py"
cp "$here/sglang_plugin_cpu_device_sync.py" "$site/eagle3_sglang_plugin_cpu_device_sync.py"
dist="$site/eagle3_sglang_cpu-0.1.dist-info"
rm -rf "$site"/eagle3_sglang_cpu-*.dist-info && mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: eagle3-sglang-cpu\nVersion: 0.1\n' > "$dist/METADATA"
{
  printf '[sglang.srt.plugins]\n'
  printf 'eagle3_intel_amx_attention = eagle3_sglang_plugin_intel_amx_attention:register\n'
  printf 'eagle3_cpu_device_sync = eagle3_sglang_plugin_cpu_device_sync:register\n'
} > "$dist/entry_points.txt"
printf 'eagle3_sglang_plugin_intel_amx_attention.py,,\neagle3_sglang_plugin_cpu_device_sync.py,,\n' > "$dist/RECORD"

# The import the server makes first, one of our ops, then the version, as a check that the venv works.
SGLANG_USE_CPU_ENGINE=1 "$venv/bin/python" -c \
  "import sglang.launch_server, sgl_kernel, torch; torch.ops.sgl_kernel.copy_all_layer_kv_cache_cpu; from sglang.srt.plugins import load_plugins; from sglang.srt.runtime_context import get_platform; load_plugins(); assert get_platform().has_amx, 'plugin not loaded'; torch.cuda.synchronize(); print('sglang', __import__('sglang').__version__, 'torch', torch.__version__, 'in $venv')"
