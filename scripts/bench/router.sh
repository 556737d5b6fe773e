#!/usr/bin/env bash
# Runs the router microbenchmark (prefix index fed by KV events from 64 nodes, 1 M indexed
# blocks; cache-aware routing decisions) on one core and writes its receipt.
# Usage: scripts/bench/router.sh [RECEIPT]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec "$root/scripts/bench/cargo-bench-receipt.sh" strata-router routing \
    "router microbenchmark: KV event ingest into the prefix index, cache-aware routing decisions" \
    "${1:-$root/docs/receipts/router-index.json}"
