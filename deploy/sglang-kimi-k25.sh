#!/usr/bin/env bash
# SGLang serving Kimi-K2.5 on the 8 GPUs of one node, for the generate stage of configs/kimi-k25.yaml
# (server.url http://127.0.0.1:30000). Not run here: this project has never had a GPU (see
# docs/status.md). Flags from SGLang's Kimi-K2.5 guide (single node, TP8 on H200) and server
# arguments; check them against the SGLang version you install (K2.5 needed SGLang main at launch).
#
# Run it by hand (server.launch: none, the default), or let the pipeline start it for the generate
# stage and stop it after, so the GPUs are free for capture and training (server.launch: command):
#
#   server:
#     url: http://127.0.0.1:30000
#     launch: command
#     command: [bash, deploy/sglang-kimi-k25.sh]   # relative to the worker's directory (EAGLE3_HOME)
#     health_timeout_s: 3600                       # loading ~0.6 TB of weights takes a while (default 600)
#
# or the same without this script (quote numbers: `command` is a list of strings):
#
#     command: [/opt/sglang/bin/python, -m, sglang.launch_server, --model-path, /models/Kimi-K2.5,
#               --tp, "8", --trust-remote-code, --host, 127.0.0.1, --port, "30000", --enable-metrics]
#
# The pipeline sends SIGTERM to the server's process group when generation ends (SIGKILL after 10 s);
# `exec` below makes SGLang the very process it started (no shell in between). Its output goes to
# RUN_DIR/logs/server.log.
#
# Environment:
#   KIMI_MODEL_PATH      the published checkpoint: a local directory (download it first) or the Hub id
#   SGLANG_PYTHON        the python of the environment SGLang is installed in (default: python3 on PATH)
#   SGLANG_HOST, SGLANG_PORT          127.0.0.1 and 30000: what configs/kimi-k25.yaml server.url expects
#   SGLANG_MEM_FRACTION_STATIC        optional: share of GPU memory for weights + KV cache; lower it on OOM
#
# Extra arguments are passed on to SGLang, e.g. `deploy/sglang-kimi-k25.sh --api-key ...` (then put the
# key in an environment variable and name it in server.api_key_env).
#
# Not needed for this pipeline: `--reasoning-parser kimi_k2 --tool-call-parser kimi_k2` (SGLang's guide
# recommends them); they act on the OpenAI-compatible endpoints only. The generate stage uses the
# native /generate with token ids, which no parser touches. Add them if people also chat with the server.
#
# Serving the trained draft afterwards (what `eagle3 eval` prints; flags from EAGLE-3 in SGLang,
# top-k 1 chains of 3 draft steps = 4 draft tokens, the setting the eval stage measures). With
# eval.backend: engine and server.launch: command, the eval stage runs this script with exactly these
# --speculative-* flags appended (docs/kimi-k25.md, 'The eval through SGLang'), then once more without them:
#
#   python3 -m sglang.launch_server --model-path "$KIMI_MODEL_PATH" --tp 8 --trust-remote-code \
#     --host 127.0.0.1 --port 30000 \
#     --speculative-algorithm EAGLE3 --speculative-draft-model-path runs/kimi-k25/draft/final \
#     --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
set -euo pipefail

model="${KIMI_MODEL_PATH:-moonshotai/Kimi-K2.5}"
python="${SGLANG_PYTHON:-python3}"

args=(
  -m sglang.launch_server
  --model-path "$model"
  --tp 8                                  # tensor parallel over the node's 8 GPUs
  --trust-remote-code                     # Kimi's tokenizer and config are remote code
  --host "${SGLANG_HOST:-127.0.0.1}"      # loopback: only this machine's pipeline talks to it
  --port "${SGLANG_PORT:-30000}"
  --enable-metrics                        # Prometheus metrics at /metrics on the same port
)
if [[ -n "${SGLANG_MEM_FRACTION_STATIC:-}" ]]; then
  args+=(--mem-fraction-static "$SGLANG_MEM_FRACTION_STATIC")
fi

exec "$python" "${args[@]}" "$@"
