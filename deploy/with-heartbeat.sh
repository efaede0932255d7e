#!/usr/bin/env bash
# with-heartbeat.sh WHAT COMMAND...: run COMMAND, printing "WHAT: N s so far" every 10 s while it runs, so a long
# quiet step (pip says nothing while it unpacks and installs, 20-60 s) never leaves `make demo` silent; exits with
# COMMAND's status. Ctrl-C or SIGTERM stop COMMAND too (bash starts a background job with SIGINT ignored).
set -u
what="$1"; shift
echo "$what ..."
started=$SECONDS
"$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 130' INT TERM
next=$((started + 10))
while kill -0 "$pid" 2>/dev/null; do
  sleep 0.5
  if ((SECONDS >= next)) && kill -0 "$pid" 2>/dev/null; then
    echo "$what: $((SECONDS - started)) s so far"
    next=$((next + 10))
  fi
done
wait "$pid"
status=$?
if ((status == 0)); then echo "$what: done in $((SECONDS - started)) s"; else echo "$what: failed (exit $status)"; fi
exit "$status"
