#!/usr/bin/env bash
# Stops what deploy/local/up.sh started: routers first (SIGTERM lets their streams finish), then
# nodes, then the raft members; each gets 30 s before SIGKILL. Data and logs stay in --dir.
# Usage: deploy/local/down.sh [--dir DIR]
set -euo pipefail
dir=./strata-local
while [[ $# -gt 0 ]]; do
    case $1 in
        --dir) dir=$2; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
pids=$dir/pids
[[ -e $pids ]] || { echo "no cluster recorded in $dir" >&2; exit 1; }
stop() {
    local pid=$1 name=$2
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid"
    for _ in $(seq 300); do
        kill -0 "$pid" 2>/dev/null || { echo "stopped $name"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    echo "killed $name (it did not stop within 30 s)"
}
for kind in router node member; do
    while read -r pid name; do
        [[ $name == "$kind"-* ]] && stop "$pid" "$name"
    done <"$pids"
done
rm -f "$pids"
