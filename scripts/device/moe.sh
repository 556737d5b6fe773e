#!/usr/bin/env bash
# Mixtures of experts on the GPU machine (issue 38's battery), with the carried release binary:
#   scripts/device/moe.sh OUT_DIR
# It builds nothing. In order:
#   1. the kernel self-test (its moe checks: the router's logits, the routing against the CPU
#      reference's rule, the sparse MLP against an f64 twin, each token alone equal to its row of
#      a batch — each with a canary);
#   2. a dense model of the same small shape (the baseline: random weights' near ties), then
#      per family, a small synthesized model (qwen3_moe with a dense layer, qwen2_moe with its
#      shared expert, mixtral): `strata gpu parity` (CUDA against the CPU reference, greedy; near
#      ties stated with their margins) and `strata gpu invariance` (32 staggered sequences equal
#      to their solo runs: prompt and decode rows share steps);
#   3. the Qwen3-30B-A3B shape (configs/qwen3-30b-a3b.json, bf16 synthesized on the device):
#      `strata gpu decode` at batch 1, 8, 32 and 64, graph replay == eager checked at 1 and 33,
#      tok/s against the byte roofline of the experts a step reads (uniform routing); one
#      profiled step per kernel family at batch 1 and 8 (decode-profile-*.txt); prefill of 512
#      and 4096 tokens (prefill-*.json, TFLOP/s of the active parameters) — each with the
#      default launches and with the grouped ones (--moe-grouped) in the same run;
#   4. served: `strata serve` on the small qwen2_moe, one request per surface (OpenAI chat,
#      Anthropic Messages, Converse).
# DEVICE=cpu runs steps 2 (invariance) and 4 on the CPU reference (the plumbing check CI runs).
# Everything lands in OUT_DIR (logs packed into logs.tar.gz); a summary last.
set -uo pipefail

OUT=${1:?usage: moe.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
DEVICE=${DEVICE:-cuda:0}
BENCH_CONFIG=${BENCH_CONFIG:-configs/qwen3-30b-a3b.json}
BATCHES=${BATCHES:-1,8,32,64}
PORT=${PORT:-18295}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
WORK=$(mktemp -d)
mkdir -p "$OUT/logs"
failed=0

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

if [[ $DEVICE == cpu ]]; then
    BATCH=8
    TOKENS=8
else
    "$BIN" kernels selftest >"$OUT/logs/selftest.log" 2>&1 || failed=1
    grep -E "moe" "$OUT/logs/selftest.log" >"$OUT/selftest-moe.txt"
    tail -n 3 "$OUT/logs/selftest.log"
    BATCH=32
    TOKENS=24
fi

# head_dim 64 (hidden / heads): the CUDA attention kernels take 64, 128 and 256.
SHAPE=(--layers 3 --hidden 256 --heads 4 --kv-heads 2 --intermediate 256
    --expert-intermediate 64 --max-position 4096)
synth() { # name arch-args...
    local name=$1
    shift
    "$BIN" model synth --out "$WORK/$name" "${SHAPE[@]}" "$@" >>"$OUT/logs/synth.log" 2>&1 ||
        { echo "synth $name FAILED"; tail -20 "$OUT/logs/synth.log"; exit 1; }
}
synth qwen3 --arch qwen3_moe --experts 16 --experts-per-token 4 --norm-topk-prob \
    --mlp-only-layers 1
synth qwen2 --arch qwen2_moe --experts 8 --experts-per-token 2 --shared-expert-intermediate 96
synth mixtral --arch mixtral --experts 8 --experts-per-token 2
# The dense baseline of the same shape: how often random weights' flat logits flip a greedy token
# between the GPU and the CPU reference without any router.
[[ $DEVICE == cpu ]] || synth dense --arch qwen3

if [[ $DEVICE != cpu ]]; then
    "$BIN" gpu parity --model "$WORK/dense" --json "$OUT/parity-dense.json" \
        >"$OUT/logs/parity-dense.log" 2>&1
    echo "dense: $(tail -n 1 "$OUT/logs/parity-dense.log")"
fi
for m in qwen3 qwen2 mixtral; do
    if [[ $DEVICE != cpu ]]; then
        "$BIN" gpu parity --model "$WORK/$m" --json "$OUT/parity-$m.json" \
            >"$OUT/logs/parity-$m.log" 2>&1 || failed=1
        echo "$m: $(tail -n 1 "$OUT/logs/parity-$m.log")"
    fi
    "$BIN" gpu invariance --model "$WORK/$m" --device "$DEVICE" --batch "$BATCH" \
        --tokens "$TOKENS" --json "$OUT/invariance-$m.json" >"$OUT/logs/invariance-$m.log" 2>&1 ||
        failed=1
    echo "$m: $(tail -n 1 "$OUT/logs/invariance-$m.log")"
done

if [[ $DEVICE != cpu ]]; then
    # The default launches, then the grouped ones (--moe-grouped, the same bits) in the same run.
    for arm in default grouped; do
        flag=()
        [[ $arm == grouped ]] && flag=(--moe-grouped)
        "$BIN" gpu decode --config "$BENCH_CONFIG" --batch "$BATCHES" --context 512 --steps 64 \
            --check-graphs 1,33 "${flag[@]}" --json "$OUT/decode-$arm.json" 2>&1 |
            tee "$OUT/logs/decode-$arm.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
        # Where a step's time goes, by kernel family (graphs off), at batch 1 and 8.
        timeout 120 "$BIN" gpu decode --config "$BENCH_CONFIG" --batch 1,8 --context 512 \
            --steps 16 --check-graphs --profile "${flag[@]}" >"$OUT/decode-profile-$arm.txt" 2>&1 ||
            failed=1
        # Prompt rows: 512 and 4096 tokens (FLOPs of the active parameters).
        timeout 150 "$BIN" gpu prefill --config "$BENCH_CONFIG" --prompt "${PROMPTS:-512,4096}" \
            --runs 2 "${flag[@]}" --json "$OUT/prefill-$arm.json" 2>&1 |
            tee "$OUT/logs/prefill-$arm.log"
        [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    done
fi

# Served: the three surfaces on the shared-expert model.
"$BIN" serve --model "$WORK/qwen2" --device "$DEVICE" --port "$PORT" --kv-cache-mib 256 \
    >"$OUT/logs/serve.log" 2>&1 &
pid=$!
if wait_healthy "$PORT" $pid; then
    ask() { # name path body
        curl -s -o "$OUT/logs/serve-$1.json" -w "%{http_code}" "http://127.0.0.1:$PORT$2" \
            -H 'content-type: application/json' -H 'anthropic-version: 2023-06-01' -d "$3"
    }
    for surface in openai anthropic converse; do
        case $surface in
        openai) code=$(ask openai /v1/chat/completions \
            '{"model":"qwen2","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}') ;;
        anthropic) code=$(ask anthropic /v1/messages \
            '{"model":"qwen2","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}') ;;
        converse) code=$(ask converse /model/qwen2/converse \
            '{"messages":[{"role":"user","content":[{"text":"hi"}]}],"inferenceConfig":{"maxTokens":8}}') ;;
        esac
        echo "served $surface: HTTP $code" | tee -a "$OUT/served.txt"
        [[ $code == 200 ]] || failed=1
    done
else
    echo "serve did not come up"; tail -20 "$OUT/logs/serve.log"; failed=1
fi
kill $pid 2>/dev/null
wait $pid 2>/dev/null

python3 - "$OUT" >"$OUT/summary.txt" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("dense", "qwen3", "qwen2", "mixtral"):
    for kind in ("parity", "invariance"):
        path = out / f"{kind}-{name}.json"
        if not path.exists():
            continue
        try:
            r = json.loads(path.read_text())
        except ValueError as e:
            print(f"{kind} {name}: unreadable ({e})")
            continue
        if kind == "parity":
            print(f"parity {name}: identical={r.get('identical')} tokens={r.get('tokens_compared')} "
                  f"near ties={len(r.get('near_ties') or [])} failures={len(r.get('failures') or [])}")
        else:
            print(f"invariance {name}: passed={r.get('passed')} batch={r.get('batch')} "
                  f"differing={r.get('differing')}")
for arm in ("default", "grouped"):
    decode = out / f"decode-{arm}.json"
    if decode.exists():
        d = json.loads(decode.read_text())
        for g in d.get("graph_checks", []):
            print(f"{arm}: graph == eager at {g['batch']}: {g['bitwise_identical']} "
                  f"(canary caught: {g['canary_caught']})")
        for r in d.get("results", []):
            print(f"{arm}: decode batch {r['batch']:>3}: {r['tokens_per_s']:.1f} tok/s, "
                  f"{r['roofline_fraction']:.3f} of the roofline ({r['weight_bytes'] / 1e9:.2f} GB read)")
    prefill = out / f"prefill-{arm}.json"
    if prefill.exists():
        for r in json.loads(prefill.read_text()).get("results", []):
            print(f"{arm}: prefill {r['prompt']:>5}: {r['ms']['median']:.1f} ms, "
                  f"{r['tokens_per_s']:.0f} tok/s, {r['tflops']:.1f} TFLOP/s")
served = out / "served.txt"
if served.exists():
    print(served.read_text().strip())
EOF
cat "$OUT/summary.txt"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$OUT/logs"
rm -rf "$WORK"
exit $failed
