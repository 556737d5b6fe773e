#!/usr/bin/env bash
# Starts a whole strata cluster on 127.0.0.1: a raft group of N members (the first holds the CA),
# a `strata node serve` beside each member (its engine, with the member's certificate, declaring
# its RPC address in the member's record), and M `strata router`s following the group (an
# operator certificate) to find the nodes. Stop it with down.sh.
#
# Usage: deploy/local/up.sh [--nodes N] [--routers M] [--model DIR] [--dir DIR] [--base-port P]
#                           [--init-args "ARGS"] [--node-args "ARGS"] [--router-args "ARGS"]
#   --model   checkpoint directory (default: the embedded demo model, synthesized once)
#   --init-args  more flags for member 1's `strata cluster init`, e.g. "--cert-lifetime 7d"
#   --node-args, --router-args  more flags for every `strata node serve` / `strata router`
#             (split on spaces), e.g. --node-args "--device cuda:0" --router-args "--kv-fetch false"
#   --dir     where data, logs and pids go (default: ./strata-local)
#   --base-port  first port used (default 17000): members P+10i (and P+10i+1 for joins),
#                nodes P+10i+2 (UDP), routers P+100+j (HTTP)
# Needs `strata` on PATH or STRATA=path/to/strata.
set -euo pipefail
nodes=3 routers=2 model="" dir=./strata-local base=17000 init_args="" node_args="" router_args=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --nodes) nodes=$2; shift 2 ;;
        --routers) routers=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --base-port) base=$2; shift 2 ;;
        --init-args) init_args=$2; shift 2 ;;
        --node-args) node_args=$2; shift 2 ;;
        --router-args) router_args=$2; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
strata=${STRATA:-strata}
command -v "$strata" >/dev/null || { echo "no strata binary: set STRATA or PATH" >&2; exit 2; }
[[ $nodes -ge 1 && $routers -ge 1 ]] || { echo "--nodes and --routers must be at least 1" >&2; exit 2; }
if [[ -e $dir/pids ]]; then
    echo "$dir/pids exists: a cluster is running there (deploy/local/down.sh --dir $dir)" >&2
    exit 1
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [[ -z $model ]]; then
    model=$dir/model
    [[ -e $model/config.json ]] || "$strata" model synth --arch llama --out "$model" >/dev/null
fi
: >"$dir/pids"

# Starts "$@" in the background, logging to $dir/$name.log, and records its pid.
spawn() {
    local name=$1
    shift
    RUST_LOG=${RUST_LOG:-info} "$@" >"$dir/$name.log" 2>&1 &
    echo "$! $name" >>"$dir/pids"
}

# Waits until the log of $1 contains $2 (up to STRATA_UP_WAIT_S seconds, default 60: a GPU node
# compiling its kernels may need more).
wait_log() {
    for _ in $(seq $((${STRATA_UP_WAIT_S:-60} * 10))); do
        grep -q -- "$2" "$dir/$1.log" 2>/dev/null && return 0
        sleep 0.1
    done
    echo "$1 did not report '$2'; see $dir/$1.log" >&2
    exit 1
}

# Waits until `cluster status` through member 1 shows $1 voters.
wait_voters() {
    for _ in $(seq 600); do
        if "$strata" cluster status --data "$dir/member-1" --json 2>/dev/null |
            python3 -c '
import json, sys
try:
    s = json.load(sys.stdin)  # empty while member 1 is not answering yet
except ValueError:
    sys.exit(1)
sys.exit(len(s["voters"]) < int(sys.argv[1]))' "$1"; then
            return 0
        fi
        sleep 0.2
    done
    echo "the group never had $1 voters" >&2
    exit 1
}

member_port() { echo $((base + 10 * $1)); }
node_port() { echo $((base + 10 * $1 + 2)); }

# shellcheck disable=SC2086 # extra flags are split on spaces on purpose
spawn member-1 "$strata" cluster init --data "$dir/member-1" --listen "127.0.0.1:$(member_port 1)" \
    $init_args
wait_voters 1
for i in $(seq 2 "$nodes"); do
    token=$dir/token-$i
    rm -f "$token"
    "$strata" cluster token --data "$dir/member-1" --out "$token" >/dev/null
    spawn "member-$i" "$strata" cluster join --data "$dir/member-$i" \
        --listen "127.0.0.1:$(member_port "$i")" \
        --seed "127.0.0.1:$(($(member_port 1) + 1))" --token "$token" --voter
    wait_voters "$i"
done
node_list=""
for i in $(seq 1 "$nodes"); do
    # shellcheck disable=SC2086 # extra flags are split on spaces on purpose
    spawn "node-$i" "$strata" node serve --model "$model" --data "$dir/member-$i" \
        --listen "127.0.0.1:$(node_port "$i")" $node_args
    node_list+="${node_list:+,}127.0.0.1:$(node_port "$i")"
done
for i in $(seq 1 "$nodes"); do wait_log "node-$i" "declared to the topology group"; done
if [[ ! -e $dir/router-identity/operator.pem ]]; then
    "$strata" cluster operator --data "$dir/member-1" --name local-router --out "$dir/router-identity" >/dev/null
fi
members=""
for i in $(seq 1 "$nodes"); do members+="${members:+,}127.0.0.1:$(member_port "$i")"; done
# No load balancer checks a local cluster's routers: they stop at once on SIGTERM (down.sh)
# rather than draining first, unless --router-args gives a delay.
[[ $router_args == *--drain-delay-s* ]] || router_args="--drain-delay-s 0 $router_args"
for j in $(seq 1 "$routers"); do
    # shellcheck disable=SC2086
    spawn "router-$j" "$strata" router --model "$model" --cluster "$members" \
        --identity "$dir/router-identity" --port $((base + 100 + j)) $router_args
done
for j in $(seq 1 "$routers"); do wait_log "router-$j" "on http://"; done
echo "raft group: $nodes voters (member 1 at 127.0.0.1:$(member_port 1))"
echo "nodes:      $node_list"
for j in $(seq 1 "$routers"); do
    echo "router $j:   http://127.0.0.1:$((base + 100 + j))/v1"
done
echo "logs and data in $dir; stop with: deploy/local/down.sh --dir $dir"
