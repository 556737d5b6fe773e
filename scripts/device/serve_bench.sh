#!/usr/bin/env bash
# Serving under load on the GPU machine (issue 17's battery), with the carried release binary:
#   scripts/device/serve_bench.sh OUT_DIR
# It builds nothing. In order:
#   1. the kernel self-test (the greedy argmax against the CPU sampler's order, with canaries);
#   2. the engine microbenchmark on the 8B shape (`strata gpu decode`: greedy on the device,
#      graph replay == eager and device sampling == host sampling checked first, with canaries);
#   3. an 8B-shaped Llama (bf16, synthesized weights, the Llama 3.1 tokenizer carried in
#      .device/llama3_1) served by `strata serve --device cuda:0` (defaults: 90 % of the GPU,
#      2 048-token steps, 256 sequences); its load time gives the weights' upload rate;
#   4. `strata bench serve` against it: 512-token prompts, 128 output tokens (ignore_eos), at
#      each concurrency of CONCURRENCY (one bench call each, /metrics read before and after for
#      the engine's step time by phase, nvidia-smi sampling GPU utilization alongside), then
#      decode-only (16-token prompts) at 64, then TTFT at concurrency 1 on fresh connections;
#   DECODE_BASELINE (a path to another strata binary) runs step 2 through it too, same run;
#   5. BASELINE (a path to another strata binary, e.g. the previous commit's) served and
#      benched the same way at the same concurrencies, when given;
#   6. RUN_ORDER=1: steps 2 and 4 again with `--run-order` (every row of a step through the
#      run-order kernels, decode and prompt rows one weight read), as the arm `runorder`, its
#      served rates set against its own microbenchmark.
# Everything lands in OUT_DIR (logs packed into logs.tar.gz) with receipt.json; a table last.
set -uo pipefail

OUT=${1:?usage: serve_bench.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
TOKENIZER=${TOKENIZER:-.device/llama3_1/tokenizer.json}
CONCURRENCY=${CONCURRENCY:-1,16,64,128}
BASELINE=${BASELINE:-}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODEL=${TMPDIR:-/tmp}/strata-serve-8b
PORT=18280
mkdir -p "$OUT/logs"
failed=0

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

"$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 || { echo "kernel selftest FAILED"; tail -40 "$OUT/logs/selftest.log"; exit 1; }
tail -n 3 "$OUT/logs/selftest.log"
"$BIN" gpu decode --config "$BENCH_CONFIG" --batch "$CONCURRENCY" --context 512 --steps 128 \
    --check-graphs 1,33 --json "$OUT/decode.json" 2>&1 | tee "$OUT/logs/decode.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
if [[ -n ${DECODE_BASELINE:-} ]]; then
    # The same microbenchmark through another binary (e.g. before a kernel change), same run.
    "$DECODE_BASELINE" gpu decode --config "$BENCH_CONFIG" --batch "$CONCURRENCY" --context 512 \
        --steps 128 --check-graphs 1,33 --json "$OUT/decode-baseline.json" 2>&1 |
        tee "$OUT/logs/decode-baseline.log"
fi

if [[ ${RUN_ORDER:-0} == 1 ]]; then
    "$BIN" gpu decode --config "$BENCH_CONFIG" --batch "$CONCURRENCY" --context 512 --steps 128 \
        --check-graphs 1,33 --run-order --json "$OUT/decode-runorder.json" 2>&1 |
        tee "$OUT/logs/decode-runorder.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
fi

# The served checkpoint: the 8B config's shape, Llama 3.1's tokenizer (its vocabulary sizes the
# embedding and LM head).
start=$SECONDS
synth_bench_model
echo "synthesized $(du -sh "$MODEL" | cut -f1) in $((SECONDS - start)) s"

serve_and_bench() { # name binary extra-serve-args...
    local name=$1 bin=$2
    shift 2
    local t0=$SECONDS
    "$bin" serve --model "$MODEL" --device cuda:0 --port $PORT "$@" >"$OUT/logs/serve-$name.log" 2>&1 &
    local pid=$!
    if ! wait_healthy "$PORT" $pid; then
        echo "serve ($name) did not come up"; tail -20 "$OUT/logs/serve-$name.log"; failed=1; return
    fi
    echo "{\"name\": \"$name\", \"ready_s\": $((SECONDS - t0))}" >"$OUT/ready-$name.json"
    point() { # label bench-args...
        local label=$1
        shift
        curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/logs/metrics-$name-$label-before.txt"
        nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 \
            >"$OUT/logs/util-$name-$label.txt" 2>/dev/null &
        local smi=$!
        "$BIN" bench serve --url "http://127.0.0.1:$PORT" --vocab-size 128000 \
            --label "$name $label" --json "$OUT/bench-$name-$label.json" "$@" 2>&1 |
            tee "$OUT/logs/bench-$name-$label.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
        kill $smi 2>/dev/null
        wait $smi 2>/dev/null
        curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/logs/metrics-$name-$label-after.txt"
    }
    for c in ${CONCURRENCY//,/ }; do
        point "c$c" --concurrency "$c" --input-len 512 --output-len 128
    done
    point decode-c64 --concurrency 64 --input-len 16 --output-len 128
    point fresh-c1 --concurrency 1 --input-len 512 --output-len 16 --connection fresh --num-prompts 16
    point reuse-c1 --concurrency 1 --input-len 512 --output-len 16 --connection reuse --num-prompts 16
    kill -TERM $pid
    wait $pid
}

serve_and_bench new "$BIN"
if [[ ${RUN_ORDER:-0} == 1 ]]; then
    "$BIN" gpu invariance --model "$MODEL" --device cuda:0 --run-order \
        --json "$OUT/invariance-runorder.json" 2>&1 | tee "$OUT/logs/invariance-runorder.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    serve_and_bench runorder "$BIN" --run-order
fi
if [[ -n $BASELINE ]]; then
    # The previous binary knew no fraction of the GPU: the same KV bytes as a fixed size.
    serve_and_bench baseline "$BASELINE" --kv-cache-mib 100000
fi

python3 "$(dirname "$0")/serve_bench_summary.py" "$OUT" "$failed"
(cd "$OUT" && tar -czf logs.tar.gz logs $(ls *.json | grep -v '^receipt.json$') && rm -rf logs \
    $(ls *.json | grep -v '^receipt.json$'))
exit $failed
