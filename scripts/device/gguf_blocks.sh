#!/usr/bin/env bash
# GGUF block formats kept quantized on the GPU (issue 18's battery), with the carried release
# binary:
#   scripts/device/gguf_blocks.sh OUT_DIR SMOLLM2.gguf TEXT
# It builds nothing. In order:
#   1. `strata kernels selftest`: every kernel against its CPU reference, including each block
#      format's dequantizer against the checkpoint loader's (bit for bit) and its GEMV, shard
#      GEMV and embedding gather against the bf16 kernels on the dequantized weights (bit for
#      bit), with canaries;
#   2. SmolLM2 (Q4_1 / Q8_0 kept as stored on the device): the chat answer names Paris, greedy
#      parity against the CPU reference (16 prompts x 64 tokens), perplexity on TEXT;
#   3. decode of the Llama-3.1-8B shape from GGUF files written by scripts/device/make_gguf.py
#      (random blocks; Q4_K_M's type mix and all-Q8_0; llama3 rope scaling as the
#      `rope_freqs.weight` tensor llama.cpp's converter writes), with the synthesized bf16 weights
#      of the same shape as the comparison. With WIDENED=1 each file's decode is also run with --widen-gguf (the
#      same bits, bf16 bytes) as an in-run control;
#   3b. with GEMMA naming gemma-3-270m-q4_k_m.gguf (part "gemma"): Gemma 3 on CUDA from its kept
#      blocks — a completion naming Paris, the same text with --widen-gguf, greedy parity
#      against the CPU reference (8 prompts x 64 tokens), perplexity on TEXT (4 chunks of 512,
#      as the CPU and llama.cpp fixtures), decode tok/s of the real file;
#   4. when LLAMA_BENCH (and LLAMA_BATCHED_BENCH) name llama.cpp binaries built on this
#      machine, the peer on the same two files: llama-bench tg128 (batch 1) and
#      llama-batched-bench at 1, 8, 32, 64 parallel sequences.
# PARTS (default "selftest,smollm2,decode,peer") picks the parts to run. Everything lands in
# OUT_DIR with receipt.json; a short table is printed last.
set -uo pipefail

OUT=${1:?usage: gguf_blocks.sh OUT_DIR SMOLLM2.gguf TEXT}
SMOL=${2:?usage: gguf_blocks.sh OUT_DIR SMOLLM2.gguf TEXT}
TEXT=${3:?usage: gguf_blocks.sh OUT_DIR SMOLLM2.gguf TEXT}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
FILES=${FILES:-${TMPDIR:-/tmp}/strata-gguf-blocks}
BATCHES=${BATCHES:-1,8,32,64}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT/logs" "$FILES"
failed=0
PARTS=${PARTS:-selftest,smollm2,gemma,decode,peer}
part() { [[ ,$PARTS, == *,$1,* ]]; }

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

if part selftest; then
    "$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 || failed=1
    tail -n 1 "$OUT/logs/selftest.log"
    grep -E "^FAIL" "$OUT/logs/selftest.log" | head -20
fi

if part smollm2; then
    "$BIN" generate --device cuda:0 --model "$SMOL" --chat \
        --prompt "What is the capital of France?" --max-tokens 32 \
        >"$OUT/logs/generate.txt" 2>"$OUT/logs/generate.log"
    cat "$OUT/logs/generate.txt"
    grep -q Paris "$OUT/logs/generate.txt" || { echo "generate: no Paris"; failed=1; }
    grep -h "projections held as" "$OUT/logs/generate.log" | tail -n 1
    "$BIN" gpu parity --model "$SMOL" --device cuda:0 --prompts 16 --tokens 64 \
        --json "$OUT/parity-smollm2.json" >"$OUT/logs/parity.log" 2>&1 || failed=1
    tail -n 2 "$OUT/logs/parity.log"
    "$BIN" eval perplexity --device cuda:0 --model "$SMOL" --text "$TEXT" --context 512 \
        --max-chunks 32 --json "$OUT/perplexity-smollm2-cuda.json" \
        >"$OUT/logs/perplexity.log" 2>&1 || failed=1
    tail -n 1 "$OUT/logs/perplexity.log"
fi

if part gemma && [[ -n ${GEMMA:-} ]]; then
    prompt="The Eiffel Tower is located in the city of"
    for mode in kept widened; do
        flag=""
        [[ $mode == widened ]] && flag="--widen-gguf"
        # shellcheck disable=SC2086
        "$BIN" generate --device cuda:0 --model "$GEMMA" --prompt "$prompt" --max-tokens 24 \
            $flag >"$OUT/logs/gemma-generate-$mode.txt" 2>"$OUT/logs/gemma-generate-$mode.log" ||
            { failed=1; tail -n 5 "$OUT/logs/gemma-generate-$mode.log"; }
    done
    cat "$OUT/logs/gemma-generate-kept.txt"
    grep -q Paris "$OUT/logs/gemma-generate-kept.txt" || { echo "gemma generate: no Paris"; failed=1; }
    cmp -s "$OUT/logs/gemma-generate-kept.txt" "$OUT/logs/gemma-generate-widened.txt" ||
        { echo "gemma: kept blocks and --widen-gguf differ"; failed=1; }
    grep -h "projections held as" "$OUT/logs/gemma-generate-kept.log" | tail -n 1
    "$BIN" gpu parity --model "$GEMMA" --device cuda:0 --prompts 8 --tokens 64 \
        --json "$OUT/parity-gemma.json" >"$OUT/logs/parity-gemma.log" 2>&1 || failed=1
    tail -n 2 "$OUT/logs/parity-gemma.log"
    "$BIN" eval perplexity --device cuda:0 --model "$GEMMA" --text "$TEXT" --context 512 \
        --max-chunks 4 --json "$OUT/perplexity-gemma-cuda.json" \
        >"$OUT/logs/perplexity-gemma.log" 2>&1 || failed=1
    tail -n 1 "$OUT/logs/perplexity-gemma.log"
    "$BIN" gpu decode --model "$GEMMA" --batch "$BATCHES" --json "$OUT/decode-gemma.json" \
        >"$OUT/logs/decode-gemma.log" 2>&1 || { failed=1; tail -n 5 "$OUT/logs/decode-gemma.log"; }
    grep -E "^decode|batch" "$OUT/logs/decode-gemma.log" | grep -v sampled
fi

# The 8B shape as GGUF files of random blocks.
part decode || part peer || QUANTS=""
for q in ${QUANTS-q4_k_m q8_0}; do
    [[ -s $FILES/llama-8b-$q.gguf ]] ||
        python3 scripts/device/make_gguf.py "$BENCH_CONFIG" "$FILES/llama-8b-$q.gguf" --dtype $q \
            >"$OUT/logs/make-$q.log" 2>&1 || { failed=1; cat "$OUT/logs/make-$q.log"; }
    cat "$FILES/llama-8b-$q.gguf" >/dev/null
    sha256sum "$FILES/llama-8b-$q.gguf" | tee -a "$OUT/machine.txt"
done
decode() { # name, args...
    local name=$1
    shift
    "$BIN" gpu decode --batch "$BATCHES" --json "$OUT/decode-$name.json" "$@" \
        >"$OUT/logs/decode-$name.log" 2>&1 || { failed=1; tail -n 5 "$OUT/logs/decode-$name.log"; }
    grep -E "^decode|batch" "$OUT/logs/decode-$name.log" | grep -v sampled
}
if part decode; then
    decode bf16 --config "$BENCH_CONFIG"
    for q in q4_k_m q8_0; do
        decode "$q" --model "$FILES/llama-8b-$q.gguf"
        [[ ${WIDENED:-0} == 1 ]] &&
            decode "$q-widened" --model "$FILES/llama-8b-$q.gguf" --widen-gguf --check-graphs
    done
fi

if part peer && [[ -n ${LLAMA_BENCH:-} ]]; then
    for q in q4_k_m q8_0; do
        "$LLAMA_BENCH" -m "$FILES/llama-8b-$q.gguf" -ngl 99 -fa 1 -p 0 -n 128 -r 5 -o json \
            >"$OUT/llamacpp-bench-$q.json" 2>"$OUT/logs/llamacpp-bench-$q.log" || failed=1
        if [[ -n ${LLAMA_BATCHED_BENCH:-} ]]; then
            "$LLAMA_BATCHED_BENCH" -m "$FILES/llama-8b-$q.gguf" -ngl 99 -fa on -c 45056 -b 2048 \
                -ub 512 -npp 512 -ntg 128 -npl 1,8,32,64 --output-format jsonl \
                >"$OUT/llamacpp-batched-$q.jsonl" 2>"$OUT/logs/llamacpp-batched-$q.log" || failed=1
        fi
    done
fi

python3 - "$OUT" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.exists(path) else None
def jsonl(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
decode = {n: load(f"decode-{n}.json") for n in ["bf16", "q4_k_m", "q4_k_m-widened", "q8_0", "q8_0-widened"]}
peer = {q: {"bench": load(f"llamacpp-bench-{q}.json"), "batched": jsonl(f"llamacpp-batched-{q}.jsonl")}
        for q in ["q4_k_m", "q8_0"]}
def lines(name):
    path = os.path.join(out, "logs", name)
    return open(path).read().splitlines() if os.path.exists(path) else []
selftest = lines("selftest.log")
receipt = {
    "what": "GGUF block formats kept quantized on the H200 (dequantized in registers inside the GEMV, into one bf16 buffer for the prompt GEMM)",
    "machine": open(os.path.join(out, "machine.txt")).read().splitlines(),
    "selftest": {"summary": selftest[-1:], "blocks": [l for l in selftest if "block" in l or "dequant" in l]},
    "smollm2": {
        "generate": "\n".join(lines("generate.txt")),
        "parity": load("parity-smollm2.json"),
        "perplexity_cuda": load("perplexity-smollm2-cuda.json"),
    },
    "gemma3": {
        "generate": "\n".join(lines("gemma-generate-kept.txt")),
        "generate_widened_identical": lines("gemma-generate-kept.txt") == lines("gemma-generate-widened.txt"),
        "parity": load("parity-gemma.json"),
        "perplexity_cuda": load("perplexity-gemma-cuda.json"),
        "decode": load("decode-gemma.json"),
    },
    "decode": decode,
    "llamacpp": peer,
}
json.dump(receipt, open(os.path.join(out, "receipt.json"), "w"), indent=1)
print("\ndecode tok/s (8B shape, context 512)")
batches = [r["batch"] for r in (decode["bf16"] or {}).get("results", [])]
def tps(d, b):
    for r in (d or {}).get("results", []):
        if r["batch"] == b:
            return r["tokens_per_s"], r["roofline_fraction"]
    return float("nan"), float("nan")
def peer_tps(q, b):
    if b == 1 and peer[q]["bench"]:
        runs = [r for r in peer[q]["bench"] if r.get("n_gen", 0) > 0]
        if runs:
            return runs[0]["avg_ts"]
    for r in peer[q]["batched"] or []:
        if r.get("pl") == b:
            return r.get("speed_tg", float("nan"))
    return float("nan")
for b in batches:
    bf = tps(decode["bf16"], b)[0]
    row = f"batch {b:>3}: bf16 {bf:7.0f}"
    for q in ["q4_k_m", "q8_0"]:
        t, f = tps(decode[q], b)
        row += f" | {q} {t:7.0f} ({t / bf:4.2f}x bf16, {100 * f:4.1f} % roofline, llama.cpp {peer_tps(q, b):7.0f})"
    print(row)
EOF
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
exit $failed
