#!/usr/bin/env bash
# Runs the engine-overhead benchmark (scheduler + block manager + prefix index + KV events, no
# model math) and writes its receipt.
# Usage: scripts/bench/engine-overhead.sh [RECEIPT]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec "$root/scripts/bench/cargo-bench-receipt.sh" strata-node engine_overhead \
    "engine overhead with a null backend: scheduler decode step, prefix index, KV event log" \
    "${1:-$root/docs/receipts/engine-overhead.json}"
