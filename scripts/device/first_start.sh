#!/usr/bin/env bash
# A first start on a machine (issue 17): `strata serve --device cuda:0` on a small synthesized
# model with an empty kernel cache (every module compiled by NVRTC and JIT-loaded), then again
# with the cache filled; the time to /health of each; then the kernel self-test (which loads
# every module, the block formats' included) with the filled cache.
#   scripts/device/first_start.sh OUT_DIR
set -uo pipefail

OUT=${1:?usage: first_start.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export XDG_CACHE_HOME=${TMPDIR:-/tmp}/strata-first-start-cache
MODEL=${TMPDIR:-/tmp}/strata-first-start-model
PORT=18282
rm -rf "$XDG_CACHE_HOME" "$MODEL"
mkdir -p "$OUT/logs"
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
"$BIN" model synth --arch llama --out "$MODEL" --layers 2 --hidden 256 --heads 4 --kv-heads 2 \
    --intermediate 512 --max-position 1024 >/dev/null || exit 1
failed=0
for run in empty-cache cached; do
    t0=$(date +%s.%N)
    "$BIN" serve --model "$MODEL" --device cuda:0 --port $PORT >"$OUT/logs/serve-$run.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 $pid 2>/dev/null || { failed=1; break; }
        sleep 0.1
    done
    t1=$(date +%s.%N)
    echo "$run: healthy after $(python3 -c "print(round($t1 - $t0, 2))") s"
    kill -TERM $pid
    wait $pid
done
"$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 || failed=1
tail -n 1 "$OUT/logs/selftest.log"
grep -c "^ok .*gemv_blocks" "$OUT/logs/selftest.log"
exit $failed
