#!/usr/bin/env bash
# The four-phase GEMV for the wide projections in the engine, and the row-warp GEMV's timings
# (issue 17), with two carried release binaries: the change ($BIN) and the one before it ($BASE).
#   scripts/device/gemv_wide.sh OUT_DIR
# 1. the gates with the change: CHECKS_ONLY battery (kernel self-test incl. the block formats'
#    four-phase GEMV against the bf16 one, parity and its canary, invariance, TP 2/4/8 against one
#    GPU in the shard order, the serve smoke);
# 2. `strata kernels bench`: the GEMV variants per 8B projection (at d4c258c also an experimental
#    row-warp kernel with 1-8 K-slices, since removed);
# 3. `strata gpu decode` on the 8B shape, the base binary then the change, in the same run (each
#    with its graph == eager and device-sampling checks).
set -uo pipefail

OUT=${1:?usage: gemv_wide.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BASE=${BASE_BIN:-.device/strata-base}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT"
failed=0
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
CHECKS_ONLY=1 STRATA_BIN=$BIN scripts/device/battery.sh "$OUT/battery" 2>&1 | tail -n 24
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
"$BIN" kernels bench --m "${BENCH_M:-1,16,32,64}" 2>&1 | tee "$OUT/kernels-bench.txt" | grep -v "^Gemm\|^F32\|^Mma  *[0-9]* *prefill"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
for which in base new; do
    bin=$BIN
    [[ $which == base ]] && bin=$BASE
    "$bin" gpu decode --config "$BENCH_CONFIG" --batch 1,16,32,64,128 --context 512 --steps 64 \
        --check-graphs 1,9,33 --json "$OUT/decode-$which.json" 2>&1 |
        grep -v "^  sampling\|^  graphs\|sampled at" | tee "$OUT/decode-$which.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
done
exit $failed
