#!/usr/bin/env bash
# The GPU check on the device machine, in one command (docs/gpu-check.md): the carried wheels (.whl/,
# made here by tools/gpu_wheels.sh) into /tmp/site, then tools/gpu_check.py with its figures in $OUT.
# Arguments go to gpu_check.py (e.g. --steps 200). PY: the Python holding torch (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check.sh: installing .whl/ failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
    echo "gpu_check.sh: no .whl/ here (run tools/gpu_wheels.sh and carry .whl): deepspeed and pydantic must be installed" >&2
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
"$PY" -c 'import deepspeed, pydantic, torch; print("deepspeed", deepspeed.__version__, "pydantic", pydantic.VERSION, "torch", torch.__version__)' \
    2>&1 | tail -1
# A net under gpu_check.py's own budget (--budget-s, 420 s): it writes its JSON after every phase, so a
# kill here still leaves what it measured in $OUT.
exec timeout -k 10 470 "$PY" tools/gpu_check.py "$@"
