#!/usr/bin/env bash
# Start a local Prefect server, create the work pools, register the deployments and start one
# worker per pool, all in the background. Stop everything with: deploy/local-up.sh stop
#
#   deploy/local-up.sh            # then open http://127.0.0.1:4200
#   prefect deployment run 'pipeline/demo'
#
# Environment: PREFECT_PORT (4200), EAGLE3_HOME (this repository), EAGLE3_STATE (.prefect-local:
# PREFECT_HOME with the SQLite database, logs and pid files). For PostgreSQL set
# PREFECT_SERVER_DATABASE_CONNECTION_URL before starting (see docs/prefect-team.md, 'PostgreSQL for the local server').
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export EAGLE3_HOME="${EAGLE3_HOME:-$here}"
state="${EAGLE3_STATE:-$EAGLE3_HOME/.prefect-local}"
port="${PREFECT_PORT:-4200}"
bin="${EAGLE3_BIN:-$EAGLE3_HOME/.venv/bin}"
export PREFECT_HOME="$state/home"
export PREFECT_API_URL="http://127.0.0.1:$port/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
mkdir -p "$state/logs" "$PREFECT_HOME"

stop() {
  for name in worker-gpu worker-cpu server; do
    if [[ -f "$state/$name.pid" ]]; then
      kill -- "-$(cat "$state/$name.pid")" 2>/dev/null || kill "$(cat "$state/$name.pid")" 2>/dev/null || true
      rm -f "$state/$name.pid"
      echo "stopped $name"
    fi
  done
}

start_bg() {  # name, command...: in its own process group, pid and log under $state
  local name="$1"; shift
  setsid "$@" >"$state/logs/$name.log" 2>&1 &
  echo $! >"$state/$name.pid"
  echo "started $name (pid $!, log $state/logs/$name.log)"
}

if [[ "${1:-up}" == "stop" ]]; then
  stop
  exit 0
fi

start_bg server "$bin/prefect" server start --host 127.0.0.1 --port "$port"
for _ in $(seq 1 120); do  # the server needs a few seconds (its database migrations on first start)
  curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
  sleep 1
done
curl -fsS "$PREFECT_API_URL/health" >/dev/null || { echo "Prefect server did not come up; see $state/logs/server.log" >&2; exit 1; }

"$bin/prefect" work-pool create eagle3-cpu --type process --overwrite >/dev/null
"$bin/prefect" work-pool create eagle3-gpu --type process --overwrite >/dev/null
"$bin/prefect" work-pool set-concurrency-limit eagle3-gpu 1 >/dev/null  # one GPU flow run at a time on the box
(cd "$EAGLE3_HOME" && "$bin/prefect" --no-prompt deploy --all >"$state/logs/deploy.log" 2>&1) \
  || { echo "prefect deploy failed; see $state/logs/deploy.log" >&2; exit 1; }
echo "deployments: $(grep -c '^  - name:' "$EAGLE3_HOME/prefect.yaml") registered from prefect.yaml"

start_bg worker-cpu "$bin/prefect" worker start --pool eagle3-cpu --type process
start_bg worker-gpu "$bin/prefect" worker start --pool eagle3-gpu --type process --limit 1

cat <<MSG
Prefect UI:  http://127.0.0.1:$port
In this shell, point the CLI at it:  export PREFECT_API_URL=$PREFECT_API_URL
Run the demo:  prefect deployment run 'pipeline/demo'
Stop:          $0 stop
MSG
