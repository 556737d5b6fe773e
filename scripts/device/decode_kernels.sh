#!/usr/bin/env bash
# The cost of batch invariance in decode (issue 17), with the carried release binary:
#   scripts/device/decode_kernels.sh OUT_DIR
# 1. `strata kernels bench`: the tensor-core GEMV against the pinned cuBLASLt GEMM (the prompt
#    rows' kernel, batch-invariant as well) on the 8B projections at 1..64 rows;
# 2. `strata gpu decode` on the 8B shape twice, decode rows through the GEMV (the default) and
#    through the GEMM (`--decode-gemm`), each with its graph == eager and sampling checks (graph
#    buckets pad the rows, so equality across them is row-count invariance).
set -uo pipefail

OUT=${1:?usage: decode_kernels.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT"
failed=0
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
"$BIN" kernels bench 2>&1 | tee "$OUT/kernels-bench.txt"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
for mode in gemv gemm; do
    flag=()
    [[ $mode == gemm ]] && flag=(--decode-gemm)
    "$BIN" gpu decode --config "$BENCH_CONFIG" --batch 1,16,32,64,128 --context 512 --steps 64 \
        --check-graphs 1,9,33 "${flag[@]}" --json "$OUT/decode-$mode.json" 2>&1 |
        grep -v "^  sampling\|^  graphs\|sampled at" | tee "$OUT/decode-$mode.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
done
exit $failed
