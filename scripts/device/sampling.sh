#!/usr/bin/env bash
# Seeded sampling on the device (issue 17), with the carried release binary:
#   scripts/device/sampling.sh OUT_DIR
# 1. the kernel self-test;
# 2. `strata gpu decode` on the 8B shape: graph replay == eager, device greedy == host greedy and
#    device seeded sampling == the CPU sampler (nine parameter mixes, summaries and draws, with
#    canaries), then step times greedy and sampled at T 0.8 on the device and from host logits;
# 3. CUDA vs CPU parity and batch invariance on small synthesized checkpoints (the weights' staged
#    upload, the scheduler's sampling paths), and TP 2 on one GPU (sliced uploads);
# 4. an 8B-shaped Llama served by `strata serve --device cuda:0` (its log gives the weights'
#    upload rate), benched at concurrency 64 greedy and at T 0.8, 512-token and 16-token prompts,
#    each point with its own prompts (a distinct seed, so no point reuses another's prefix cache).
# Everything lands in OUT_DIR with receipt.json.
set -uo pipefail

OUT=${1:?usage: sampling.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
TOKENIZER=${TOKENIZER:-.device/llama3_1/tokenizer.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODEL=${TMPDIR:-/tmp}/strata-serve-8b
PORT=18281
mkdir -p "$OUT/logs"
failed=0

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

"$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 || { echo "kernel selftest FAILED"; tail -40 "$OUT/logs/selftest.log"; exit 1; }
tail -n 2 "$OUT/logs/selftest.log"
"$BIN" gpu decode --config "$BENCH_CONFIG" --batch 1,16,64,128 --context 512 --steps 64 \
    --check-graphs 1,9,33 --json "$OUT/decode.json" 2>&1 | tee "$OUT/logs/decode.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

SMALL=${TMPDIR:-/tmp}/strata-small
"$BIN" model synth --arch llama --out "$SMALL" --layers 4 --hidden 512 --heads 8 --kv-heads 2 \
    --intermediate 1024 --max-position 2048 >/dev/null 2>&1
for check in "parity --model $SMALL" "invariance --model $SMALL" "tp --model $SMALL --tp 2"; do
    name=${check%% *}
    # shellcheck disable=SC2086
    if "$BIN" gpu $check --json "$OUT/$name.json" >"$OUT/logs/$name.log" 2>&1; then
        echo "gpu $name: PASS"
    else
        echo "gpu $name: FAIL"; tail -5 "$OUT/logs/$name.log"; failed=1
    fi
done

synth_bench_model

t0=$SECONDS
"$BIN" serve --model "$MODEL" --device cuda:0 --port $PORT >"$OUT/logs/serve.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && { up=1; break; }
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
done
echo "serve ready after $((SECONDS - t0)) s"
grep -E "uploaded .* of weights" "$OUT/logs/serve.log" | sed 's/^.*uploaded/uploaded/' | tee "$OUT/upload.txt"
if [[ $up == 1 ]]; then
    for point in "greedy 512 0 1" "sampled 512 0.8 2" "greedy 16 0 3" "sampled 16 0.8 4"; do
        read -r name input temp seed <<<"$point"
        "$BIN" bench serve --url "http://127.0.0.1:$PORT" --concurrency 64 --seed "$seed" \
            --input-len "$input" --output-len 128 --vocab-size 128000 --temperature "$temp" \
            --json "$OUT/bench-$name-$input.json" >"$OUT/logs/bench-$name-$input.log" 2>&1 || failed=1
        python3 - "$OUT/bench-$name-$input.json" "$name" "$input" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = r["points"][0]
print(f"  c=64 {sys.argv[2]:>7} prompt {sys.argv[3]:>3}: {p['output_tok_s']:8.0f} tok/s, "
      f"ITL p50 {p['itl_ms']['p50']:.1f} ms, TTFT p50 {p['ttft_ms']['p50']:.0f} ms")
PY
    done
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "strata_engine_step" >"$OUT/metrics.txt"
else
    echo "serve did not come up"; tail -20 "$OUT/logs/serve.log"; failed=1
fi
kill $pid 2>/dev/null; wait $pid 2>/dev/null
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
receipt = {"decode": json.load(open(f"{out}/decode.json")) if os.path.exists(f"{out}/decode.json") else None,
           "serve": {os.path.basename(f)[6:-5]: json.load(open(f))["points"][0]
                     for f in sorted(glob.glob(f"{out}/bench-*.json"))},
           "checks": {n: json.load(open(f"{out}/{n}.json")) for n in ("parity", "invariance", "tp")
                      if os.path.exists(f"{out}/{n}.json")},
           "upload": open(f"{out}/upload.txt").read().strip() if os.path.exists(f"{out}/upload.txt") else None,
           "machine": open(f"{out}/machine.txt").read()}
json.dump(receipt, open(f"{out}/receipt.json", "w"), indent=1)
PY
exit $failed
