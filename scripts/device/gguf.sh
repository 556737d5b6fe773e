#!/usr/bin/env bash
# A real GGUF model on the GPU machine (issue 18's battery), with the carried release binary:
#   scripts/device/gguf.sh OUT_DIR MODEL.gguf TEXT
# It builds nothing. In order:
#   1. `strata generate --device cuda:0` with the chat template: the answer to "What is the
#      capital of France?" must name Paris;
#   2. `strata gpu parity`: greedy tokens on the GPU against the CPU reference on the same file
#      (64 tokens on each of 16 prompts; a flip counts as a near tie only below the reference's
#      top-2 margin);
#   3. `strata eval perplexity` on the GPU and on the CPU (TEXT, 512-token chunks, first
#      $PPL_CHUNKS chunks);
#   4. `strata serve --device cuda:0` on the file and `strata bench serve` against it.
# Everything lands in OUT_DIR with receipt.json.
set -uo pipefail

OUT=${1:?usage: gguf.sh OUT_DIR MODEL.gguf TEXT}
MODEL=${2:?usage: gguf.sh OUT_DIR MODEL.gguf TEXT}
TEXT=${3:?usage: gguf.sh OUT_DIR MODEL.gguf TEXT}
BIN=${STRATA_BIN:-.device/strata}
PPL_CHUNKS=${PPL_CHUNKS:-32}
CONCURRENCY=${CONCURRENCY:-1,16,64}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PORT=18281
mkdir -p "$OUT/logs"
failed=0

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
sha256sum "$MODEL" | tee -a "$OUT/machine.txt"

"$BIN" generate --device cuda:0 --model "$MODEL" --chat --prompt "What is the capital of France?" \
    --max-tokens 32 >"$OUT/logs/generate.txt" 2>"$OUT/logs/generate.log"
cat "$OUT/logs/generate.txt"
grep -q Paris "$OUT/logs/generate.txt" || { echo "generate: no Paris"; failed=1; }

"$BIN" gpu parity --model "$MODEL" --device cuda:0 --prompts 16 --tokens 64 \
    --json "$OUT/parity.json" 2>&1 | tee "$OUT/logs/parity.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1

for device in cuda:0 cpu; do
    "$BIN" eval perplexity --device "$device" --model "$MODEL" --text "$TEXT" --context 512 \
        --max-chunks "$PPL_CHUNKS" --json "$OUT/perplexity-${device%%:*}.json" \
        >"$OUT/logs/perplexity-${device%%:*}.log" 2>&1 || failed=1
    tail -n 1 "$OUT/logs/perplexity-${device%%:*}.log"
done

"$BIN" serve --model "$MODEL" --device cuda:0 --port $PORT >"$OUT/logs/serve.log" 2>&1 &
pid=$!
for _ in $(seq 120); do
    grep -q "serving \`" "$OUT/logs/serve.log" && break
    sleep 0.5
done
"$BIN" bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --input-len 256 \
    --output-len 128 --num-prompts 256 --json "$OUT/bench.json" 2>&1 | tee "$OUT/logs/bench.log"
[[ ${PIPESTATUS[0]} == 0 ]] || failed=1
kill $pid
wait $pid 2>/dev/null

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
receipt = {
    "what": "a real GGUF model (SmolLM2-135M-Instruct Q4_1; block types widened to bf16 on the GPU, f32 on the CPU) on the H200",
    "machine": open(os.path.join(out, "machine.txt")).read().splitlines(),
    "generate": open(os.path.join(out, "logs/generate.txt")).read().strip(),
    "parity": load("parity.json"),
    "perplexity": {"cuda": load("perplexity-cuda.json"), "cpu": load("perplexity-cpu.json")},
    "bench": load("bench.json"),
}
json.dump(receipt, open(os.path.join(out, "receipt.json"), "w"), indent=1)
EOF
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $failed
