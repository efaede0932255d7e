#!/usr/bin/env bash
# The wheels the GPU machine lacks for tools/gpu_check.py, into .whl/ (gitignored), at the versions of
# this checkout's .venv (what the CPU tests ran). Run here, on a machine with pip access; the GPU machine
# has no registry. docs/gpu-check.md says how they travel (run's `carry`) and why these and no others.
#
# The GPU machine (Python 3.12, x86-64; /work/.library/device/KINDS.md lists its packages) already has
# torch, transformers, tokenizers, safetensors, accelerate, pyarrow, numpy, pyyaml, tensorboard, einops,
# msgpack, ninja, psutil, py-cpuinfo, tqdm and packaging. It lacks:
#   deepspeed                      the launcher and ZeRO; PyPI has only its sdist: built here into a
#                                  pure-Python wheel (no compiled ops: the check uses torch's AdamW)
#   hjson                          deepspeed's
#   pydantic, pydantic-core,       settings/, the job files and deepspeed; pydantic-core is compiled (cp312, manylinux)
#   annotated-types, typing-inspection
#   typing-extensions              pydantic needs a recent one; the machine's version is unknown
# Prefect, httpx, fastapi... are not needed: the check launches the ranks through tasks/runtime/launch_ranks.py, which
# imports none of them (tests/tasks/test_launch_ranks.py, tests/tools/test_gpu_check.py).
#
#   tools/gpu_wheels.sh            # PY=.venv/bin/python by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }

rm -rf .whl
mkdir -p .whl
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions hjson; do
    pins+=("$name==$(version "$name")")
done
echo "downloading ${pins[*]} (Python 3.12, manylinux x86_64)"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ds="deepspeed==$(version deepspeed)"
echo "building $ds (pure Python: DS_BUILD_OPS=0, ops are JIT-built where used)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds"
ls -l .whl
du -sh .whl
