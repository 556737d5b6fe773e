#!/usr/bin/env bash
# The split narrow projections (issue 17): q/k/v, o and down's decode rows cut into K-slices
# through the four-phase GEMV (`--split-narrow`), against the unsplit kernels, one binary.
#   scripts/device/split_narrow.sh OUT_DIR
# 1. `strata kernels selftest` (the shard GEMV in both variants against the reference, row 0 of
#    40 rows against one row alone, the split q/k/v launch against per-projection shard launches,
#    the three-way slice sum against the shard sum; each with a canary);
# 2. `strata gpu tp --split-narrow` at TP 2/4/8 on a synthesized llama against one GPU in the
#    shard order (with its canary);
# 3. `strata gpu decode` on the 8B shape, unsplit then split, in the same run (each with its
#    graph == eager and device-sampling checks), then one profiled step of each at 64 rows.
set -uo pipefail

OUT=${1:?usage: split_narrow.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODELS=${TMPDIR:-/tmp}/strata-split-models
mkdir -p "$OUT" "$MODELS"
failed=0
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
"$BIN" kernels selftest >"$OUT/selftest.txt" 2>&1 || failed=1
grep -c PASS "$OUT/selftest.txt"
grep -i "fail" "$OUT/selftest.txt" | head -n 20
"$BIN" model synth --arch llama --out "$MODELS/llama" --layers 4 --hidden 512 --heads 8 \
    --kv-heads 2 --intermediate 1024 --max-position 2048 --rope-theta 500000 >/dev/null
"$BIN" gpu tp --model "$MODELS/llama" --tp 2,4,8 --split-narrow --json "$OUT/tp-split.json" \
    2>&1 | tee "$OUT/tp-split.txt" | grep -v "^  "
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
for arm in unsplit split; do
    flag=()
    [[ $arm == split ]] && flag=(--split-narrow)
    "$BIN" gpu decode --config "$BENCH_CONFIG" --batch 1,16,32,64,128 --context 512 --steps 64 \
        --check-graphs 1,9,33 "${flag[@]}" --json "$OUT/decode-$arm.json" 2>&1 |
        grep -v "^  sampling\|^  graphs\|sampled at" | tee "$OUT/decode-$arm.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
done
for arm in unsplit split; do
    flag=()
    [[ $arm == split ]] && flag=(--split-narrow)
    "$BIN" gpu decode --config "$BENCH_CONFIG" --batch 1,64 --context 512 --steps 16 \
        --check-graphs --profile "${flag[@]}" --json "$OUT/profile-$arm.json" \
        >"$OUT/profile-$arm.txt" 2>&1 || failed=1
    grep -A14 "profile" "$OUT/profile-$arm.txt" | head -n 40
done
exit $failed
