#!/usr/bin/env bash
# pip-install.sh VENV ARGS...: `VENV/bin/pip install ARGS`, done by uv (`uv pip install`) when uv can be had: the same
# packages at the same versions, faster (on 2 cores, the real vLLM's venv from a warm cache: 21 s; in CI, the three
# venvs side by side from an empty cache: 157 s, against 185-224 s with pip). uv does not read pip's configuration,
# so pip's own (pip.conf and the PIP_* variables, as `pip config list` prints them: index-url, extra-index-url,
# find-links, no-index, constraint) is passed to it as flags, and it weighs every index as pip does
# (--index-strategy unsafe-best-match).
# uv comes from the package index into VENV (its wheel, about 20 MB). Where it cannot be had, or with
# EAGLE3_PIP_INSTALL=pip, pip installs, as before.
set -euo pipefail
venv="${1:?usage: pip-install.sh VENV ARGS...}"
shift
uv="$venv/bin/uv"
if [[ "${EAGLE3_PIP_INSTALL:-uv}" != pip && ! -x "$uv" ]]; then
  "$venv/bin/pip" install -q uv==0.13.9 >/dev/null 2>&1 \
    || echo "pip-install.sh: uv could not be installed; pip installs"
fi
if [[ "${EAGLE3_PIP_INSTALL:-uv}" == pip || ! -x "$uv" ]]; then
  exec "$venv/bin/pip" install "$@"
fi

flags=()
while IFS= read -r line; do  # e.g. global.find-links='/opt/wheels' or :env:.extra-index-url='URL URL'
  key="${line%%=*}"
  key="${key##*.}"
  value="${line#*=}"
  value="${value#\'}"
  value="${value%\'}"
  case "$key" in
    index-url) flags+=(--index-url "$value") ;;
    no-index) [[ "$value" =~ ^(1|true|yes|on)$ ]] && flags+=(--no-index) ;;
    extra-index-url | find-links | constraint)
      for v in $value; do flags+=("--$key" "$v"); done ;;
  esac
done < <("$venv/bin/pip" config list 2>/dev/null)

args=()
for a in "$@"; do  # pip's flags uv does not take, and that change nothing uv does
  [[ "$a" == --no-warn-conflicts ]] || args+=("$a")
done
# .pyc files: Python writes one for each module a process imports, the first time, unless PYTHONDONTWRITEBYTECODE is
# set; then it writes none, and every process would compile every module it imports (torch, transformers, vLLM,
# SGLang) from source again. Only there are they compiled as pip compiles them, all at install (--compile-bytecode:
# about 65,000 files over the three venvs, some 170 s of a core; a run of the suite imports a third of them).
compile=()
[[ -z "${PYTHONDONTWRITEBYTECODE:-}" ]] || compile=(--compile-bytecode)
exec "$uv" pip install --python "$venv/bin/python" --index-strategy unsafe-best-match "${compile[@]}" "${flags[@]}" \
  "${args[@]}"
