#!/usr/bin/env bash
# Start a local Prefect server, create the work pools, register the deployments and start one
# worker per pool, all in the background. Stop everything with: deploy/local-up.sh stop
#
#   deploy/local-up.sh            # then open http://127.0.0.1:4200
#   prefect deployment run 'pipeline/demo'
#
# Environment: PREFECT_PORT (4200), EAGLE3_HOME (this repository), EAGLE3_STATE (.prefect-local:
# PREFECT_HOME with the SQLite database, logs and pid files). For PostgreSQL set
# PREFECT_SERVER_DATABASE_CONNECTION_URL before starting (see docs/prefect.md, 'A server for a team').
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

# Stop what `up` started, workers first (a worker that loses the server mid-shutdown retries its API calls), each as
# a process group with every descendant (a flow run a worker started may have left the group): SIGTERM (a Prefect
# worker turns it into its graceful SIGINT), up to EAGLE3_STOP_TIMEOUT seconds (20) for it to exit, then SIGKILL.
# A pid file goes only once its processes are gone; what could not be stopped is named, the pid file kept (run
# `stop` again), and the exit status is 1.
stop_timeout="${EAGLE3_STOP_TIMEOUT:-20}"
default_int=(env --default-signal=INT,QUIT)  # GNU env (coreutils >= 8.31); without it, as bash leaves them
env --default-signal=INT true 2>/dev/null || default_int=()

alive() {  # pids...: those still running (a zombie waiting for its parent is not)
  local p
  for p in "$@"; do
    if [[ -r /proc/$p/stat ]] && [[ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ]]; then echo "$p"; fi
  done
  return 0
}

family() {  # pid: it and every descendant (read from ps, before anything is killed: orphans lose their parent)
  local all=("$1") i=0 child
  while (( i < ${#all[@]} )); do
    for child in $(ps -e -o pid=,ppid= | awk -v p="${all[i]}" '$2 == p {print $1}'); do all+=("$child"); done
    i=$((i + 1))
  done
  echo "${all[@]}"
}

signal_all() {  # signal, leader, pids...: the leader's process group and each pid
  local sig="$1" leader="$2"; shift 2
  kill "-$sig" -- "-$leader" 2>/dev/null || true
  local p; for p in "$@"; do kill "-$sig" "$p" 2>/dev/null || true; done
}

stop_group() {  # names...: stop these at once (see above); 1 if one could not be stopped
  local failed=0 name pid waited=0 left
  local -A members=()
  for name in "$@"; do
    [[ -f "$state/$name.pid" ]] || continue
    pid="$(cat "$state/$name.pid")"
    members[$name]="$(family "$pid")"
    # shellcheck disable=SC2086
    signal_all TERM "$pid" ${members[$name]}
  done
  (( ${#members[@]} )) || return 0
  # shellcheck disable=SC2086,SC2048
  while [[ -n "$(alive ${members[*]})" ]] && (( waited < stop_timeout * 10 )); do sleep 0.1; waited=$((waited + 1)); done
  for name in "${!members[@]}"; do
    pid="$(cat "$state/$name.pid")"
    # shellcheck disable=SC2086
    if [[ -n "$(alive ${members[$name]})" ]]; then
      echo "$name (pid $pid) still running ${stop_timeout}s after SIGTERM: SIGKILL"
      # shellcheck disable=SC2086
      signal_all KILL "$pid" ${members[$name]}
      # shellcheck disable=SC2086
      for _ in $(seq 1 50); do [[ -z "$(alive ${members[$name]})" ]] && break; sleep 0.1; done
    fi
    # shellcheck disable=SC2086
    left="$(alive ${members[$name]} | tr '\n' ' ')"
    if [[ -n "$left" ]]; then
      echo "could not stop $name: pid(s) ${left% } still running; $state/$name.pid kept (run '$0 stop' again)" >&2
      failed=1
    else
      rm -f "$state/$name.pid"
      echo "stopped $name (pid $pid)"
    fi
  done
  return "$failed"
}

stop() {
  local failed=0
  stop_group worker-gpu worker-cpu || failed=1
  stop_group server || failed=1
  return "$failed"
}

start_bg() {  # name, command...: a session (process group) of its own whose leader is the command; pid and log under $state
  local name="$1"; shift
  # the leader writes its own pid: setsid forks when it is a group leader already, then $! would be a pid gone at once
  # and SIGINT back to its default: bash starts a background command with it ignored, and a Prefect worker turns the
  # SIGTERM of `stop` into a SIGINT to itself, which it then never sees (it stops only when killed)
  setsid "${default_int[@]}" bash -c 'echo $$ >"$0"; exec "$@"' "$state/$name.pid" "$@" >"$state/logs/$name.log" 2>&1 &
  for _ in $(seq 1 50); do [[ -s "$state/$name.pid" ]] && break; sleep 0.1; done
  echo "started $name (pid $(cat "$state/$name.pid"), log $state/logs/$name.log)"
}

if [[ "${1:-up}" == "stop" ]]; then
  stop
  exit
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
