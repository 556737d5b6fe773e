#!/usr/bin/env bash
# How fast a 16 GB checkpoint in the page cache reaches the GPU (issue 17), with the carried
# release binary: the 8B shape synthesized (bf16, Llama 3.1 tokenizer), read once into the page
# cache, then `strata serve --device cuda:0` started twice; each start's log line "uploaded X GB
# of weights in S s (R GB/s)" and the time to /health are recorded.
#   scripts/device/weight_upload.sh OUT_DIR
set -uo pipefail

OUT=${1:?usage: weight_upload.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
TOKENIZER=${TOKENIZER:-.device/llama3_1/tokenizer.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODEL=${TMPDIR:-/tmp}/strata-upload-8b
PORT=18281
mkdir -p "$OUT/logs"
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
start=$SECONDS
synth_bench_model
echo "synthesized $(du -sh "$MODEL" | cut -f1) in $((SECONDS - start)) s"
for run in 1 2; do
    t0=$(date +%s.%N)
    "$BIN" serve --model "$MODEL" --device cuda:0 --port $PORT >"$OUT/logs/serve-$run.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
        kill -0 $pid 2>/dev/null || break
        sleep 0.2
    done
    t1=$(date +%s.%N)
    echo "run $run: healthy after $(python3 -c "print(round($t1 - $t0, 2))") s; $(grep -o 'uploaded .*' "$OUT/logs/serve-$run.log")"
    kill -TERM $pid
    wait $pid
done
