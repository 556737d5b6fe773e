#!/usr/bin/env bash
# Hardware counters of the kernels the open performance aims hang on, with the carried release
# binary (issues 17, 18, 22):
#   scripts/device/profile.sh OUT_DIR
# Nsight Compute (`ncu --clock-control none`: the clocks stay as the machine runs them) on
#   1. the decode GEMV at one row, bf16 against the block formats (Q4_K, Q8_0, NVFP4, FP8), on
#      the first shape `strata kernels bench` launches (the 8B qkv projection, 6144 × 4096) —
#      why the block formats run below their byte roofline (the in-register dequantization is
#      the suspect: issue slots, not DRAM, should be the limiter);
#   2. the same bf16 GEMV at 64 rows (batched decode at 46 % of the HBM roofline);
#   3. the split-KV decode attention and its combine at 64 sequences of 512 tokens in
#      `strata gpu decode` (2.5 ms of a 10.4 ms step against ~1 ms of KV bytes).
# Each kernel's sections go to OUT_DIR/ncu-<name>.csv (raw, one row per metric) and a summary
# line per kernel (duration, DRAM and SM throughput, issue-slot use, top stall reasons, registers,
# occupancy) to OUT_DIR/summary.txt. If ncu cannot read the counters (a gVisor machine), the
# script says so and exits 2.
set -uo pipefail

OUT=${1:?usage: profile.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT/logs"
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
[[ -x $NCU ]] || { echo "no ncu on this machine"; exit 2; }
SECTIONS=(--section SpeedOfLight --section LaunchStats --section Occupancy
    --section WarpStateStats --section SchedulerStats --section InstructionStats
    --section MemoryWorkloadAnalysis
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$')
failed=0

# profile NAME REGEX COMMAND...: the first launch of a kernel matching REGEX.
profile() {
    local name=$1 regex=$2
    shift 2
    "$NCU" --clock-control none --kernel-name "regex:$regex" --launch-count 1 "${SECTIONS[@]}" \
        --csv --page details "$@" >"$OUT/ncu-$name.csv" 2>"$OUT/logs/ncu-$name.log"
    local rc=$?
    if ! grep -q '"Duration"' "$OUT/ncu-$name.csv"; then
        echo "$name: ncu read no counters (rc $rc)"
        tail -5 "$OUT/logs/ncu-$name.log"
        grep -q "LibraryNotLoaded\|ERR_NVGPUCTRPERM\|not supported" "$OUT/logs/ncu-$name.log" &&
            exit 2
        failed=1
    fi
}

# The kernel bench at one row, then at 64 rows.
for fmt in bf16 q4_k q8_0 nvfp4 fp8; do
    profile "gemv-$fmt-m1" "^gemv_mma_${fmt}_x1$|^gemv_mma_${fmt}_bf16_x1$" "$BIN" kernels bench --m 1
done
profile "gemv-bf16-m64" "^gemv_mma2?_bf16_x4$" "$BIN" kernels bench --m 64
# Decode attention at 64 sequences (graphs off so the launches are plain kernels).
for k in attn_decode_d128 attn_decode_combine; do
    profile "$k-b64" "^$k" "$BIN" gpu decode --config "$BENCH_CONFIG" --batch 64 --context 512 \
        --steps 4 --check-graphs
done

# One line per kernel from the raw sections.
python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import csv, pathlib, sys
out = pathlib.Path(sys.argv[1])
want = {
    "Duration": "time", "DRAM Throughput": "dram %", "Compute (SM) Throughput": "sm %",
    "Issue Slots Busy": "issue %", "Registers Per Thread": "regs", "Achieved Occupancy": "occ %",
    "Memory Throughput": "mem %",
}
for path in sorted(out.glob("ncu-*.csv")):
    rows = list(csv.DictReader(l for l in path.open() if l.startswith('"')))
    if not rows:
        print(f"{path.stem}: no rows")
        continue
    kernel = rows[0].get("Kernel Name", "?")
    seen = {}
    stalls = []
    for r in rows:
        m, v, u = r.get("Metric Name", ""), r.get("Metric Value", ""), r.get("Metric Unit", "")
        if m in want and want[m] not in seen:
            seen[want[m]] = f"{v} {u}".strip()
        if m.startswith("Stall ") or "stall" in m.lower():
            try:
                stalls.append((float(v.replace(",", "")), m))
            except ValueError:
                pass
    top = ", ".join(f"{m} {v:.2f}" for v, m in sorted(stalls, reverse=True)[:3])
    fields = "  ".join(f"{k} {v}" for k, v in seen.items())
    print(f"{path.stem:<28} {kernel:<32} {fields}  stalls: {top}")
EOF
exit $failed
