#!/usr/bin/env bash
# Speculative decoding on the GPU machine (issue 35's battery), with the carried release binary:
#   scripts/device/spec.sh OUT_DIR
# It builds nothing. In order:
#   1. the kernel self-test;
#   2. the standing gate's CUDA arm: a small synthesized Llama, `strata bench spec` with n-gram
#      draft lengths 1..8, greedy and seeded sampling, 16 requests at concurrency 1 and 8 —
#      every output byte-identical to plain decoding in the same run (verification rows are
#      decode rows: the split-KV attention with several query rows of one sequence, graphs
#      bucketed by rows);
#   3. the draft-model proposer: the small model drafting for itself (greedy proposals all
#      accepted), identity again;
#   4. the 8B shape (bf16, synthesized weights) at concurrency 1, 8 and 64 with k = 2, 4, 8
#      beside plain decoding: identity again, acceptance, decode speed (random weights: the
#      acceptance is the model's loops, the cost is the real one);
#   5. served: `strata serve` on the 8B shape with and without `--speculative-config`, `strata
#      bench serve` at concurrency 1, 8 and 64 (random prompts: the policy must keep throughput
#      at 64 no lower than without).
# DEVICE=cpu runs the same steps on the CPU reference with small shapes (the plumbing check CI
# runs). Everything lands in OUT_DIR (logs packed into logs.tar.gz); a table last.
set -uo pipefail

OUT=${1:?usage: spec.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
DEVICE=${DEVICE:-cuda:0}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
WORK=$(mktemp -d)
MODEL=$WORK/bench
PORT=${PORT:-18290}
mkdir -p "$OUT/logs"
failed=0

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

if [[ $DEVICE == cpu ]]; then
    SMALL=(--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128)
    BIG=(--layers 2 --hidden 128 --heads 4 --kv-heads 2 --intermediate 256)
    GATE_K=1,8
    TOKENS=24
    CONC=1,8
    SERVE_CONC=1,8
    PROMPTS=8
else
    "$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 ||
        { echo "kernel selftest FAILED"; tail -40 "$OUT/logs/selftest.log"; exit 1; }
    tail -n 3 "$OUT/logs/selftest.log"
    SMALL=(--layers 4 --hidden 512 --heads 8 --kv-heads 4 --intermediate 1536)
    BIG=(--layers "$(shape num_hidden_layers)" --hidden "$(shape hidden_size)"
        --heads "$(shape num_attention_heads)" --kv-heads "$(shape num_key_value_heads)"
        --intermediate "$(shape intermediate_size)")
    GATE_K=1,2,3,4,5,6,7,8
    TOKENS=128
    CONC=1,8,64
    SERVE_CONC=8,64
    PROMPTS=64
fi

synth() { # dir shape-args...
    local dir=$1
    shift
    "$BIN" model synth --arch llama --out "$dir" --max-position 4096 --rope-theta 500000 "$@" \
        >>"$OUT/logs/synth.log" 2>&1 || { echo "synth FAILED"; tail -20 "$OUT/logs/synth.log"; exit 1; }
}

synth "$WORK/small" "${SMALL[@]}"
"$BIN" bench spec --model "$WORK/small" --device "$DEVICE" --token-prompts --k "$GATE_K" \
    --concurrency 1,8 --requests 16 --tokens "$TOKENS" --sampled --kv-cache-mib 512 \
    --json "$OUT/gate.json" 2>&1 | tee "$OUT/logs/gate.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

# The draft-model proposer on the same device: the small model drafts for itself, so every
# greedy proposal must be accepted, and every output must still match plain decoding.
"$BIN" bench spec --model "$WORK/small" --device "$DEVICE" --token-prompts --k 3,8 \
    --concurrency 1,8 --requests 16 --tokens "$TOKENS" --kv-cache-mib 512 \
    --draft-model "$WORK/small" --json "$OUT/draft.json" 2>&1 | tee "$OUT/logs/draft.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

start=$SECONDS
synth "$MODEL" "${BIG[@]}"
cat "$MODEL"/*.safetensors >/dev/null
echo "synthesized $(du -sh "$MODEL" | cut -f1) in $((SECONDS - start)) s"
"$BIN" bench spec --model "$MODEL" --device "$DEVICE" --token-prompts --k 2,4,8 \
    --concurrency "$CONC" --requests 8 --tokens "$TOKENS" --kv-cache-mib 8192 \
    --json "$OUT/speed.json" 2>&1 | tee "$OUT/logs/speed.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

serve_point() { # arm extra-serve-args...
    local arm=$1
    shift
    "$BIN" serve --model "$MODEL" --device "$DEVICE" --port "$PORT" --kv-cache-mib 8192 "$@" \
        >"$OUT/logs/serve-$arm.log" 2>&1 &
    local pid=$!
    if ! wait_healthy "$PORT" $pid; then
        echo "serve ($arm) did not come up"; tail -20 "$OUT/logs/serve-$arm.log"; failed=1; return
    fi
    for c in ${SERVE_CONC//,/ }; do
        "$BIN" bench serve --url "http://127.0.0.1:$PORT" --vocab-size 300 --concurrency "$c" \
            --input-len 256 --output-len "$TOKENS" --num-prompts "$PROMPTS" --label "$arm c$c" \
            --json "$OUT/logs/serve-$arm-c$c.json" 2>&1 | tee "$OUT/logs/bench-$arm-c$c.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    done
    curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/logs/metrics-$arm.txt"
    kill $pid
    wait $pid 2>/dev/null
}
serve_point plain
serve_point ngram4 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

python3 - "$OUT" "$SERVE_CONC" >"$OUT/summary.txt" <<'EOF'
import json, sys
out, conc = sys.argv[1], sys.argv[2].split(",")
for name in ("gate", "draft", "speed"):
    try:
        r = json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError) as e:
        print(f"{name}: no report ({e})")
        continue
    print(f"{name}: identical={r['identical']} ({r['requests']} requests, device {r['device']})")
    for arm in r["arms"]:
        k = arm["config"]["num_speculative_tokens"]
        for p in arm["points"]:
            print(f"  k={k} c={p['concurrency']}: identical={p['identical']} "
                  f"acceptance={p['acceptance_rate']:.3f} mean_len={p['mean_accepted_len']:.2f} "
                  f"decode {p['spec']['decode_tok_per_s']:.1f} vs {p['plain']['decode_tok_per_s']:.1f} "
                  f"tok/s per sequence = {p['decode_speedup']:.2f}x; output "
                  f"{p['spec']['output_tok_per_s']:.1f} vs {p['plain']['output_tok_per_s']:.1f} "
                  f"tok/s = {p['output_speedup']:.2f}x")
def rate(path):
    try:
        r = json.load(open(path))
    except (OSError, ValueError):
        return None
    points = r.get("points", [r])
    return points[0].get("output_tok_s") if points else None
for c in conc:
    a, b = rate(f"{out}/logs/serve-plain-c{c}.json"), rate(f"{out}/logs/serve-ngram4-c{c}.json")
    print(f"served c={c}: plain {a} tok/s, ngram k=4 {b} tok/s")
EOF
cat "$OUT/summary.txt"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$OUT/logs"
rm -rf "$WORK"
exit $failed
