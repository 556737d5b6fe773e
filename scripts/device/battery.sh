#!/usr/bin/env bash
# The CUDA backend's device battery, run on the GPU machine with the carried release binary:
#   scripts/device/battery.sh OUT_DIR
# It builds nothing. In order: the GPU inventory (`strata node inspect`), the kernel self-test
# against CPU references (with canaries), the NCCL communicator against the host reference, greedy
# parity GPU vs the CPU reference on synthesized models (and a canary that must fail), batch
# invariance on the GPU, a `strata serve --device cuda:0` smoke over the three surfaces, then the
# benchmarks (kernel timings; decode, whose graph replay is first checked bit for bit against eager
# launches; prefill; the PyTorch eager peer on the same shapes). A llama.cpp peer result measured
# earlier on the same machine kind is merged when PEER_DIR (default .device/peer) holds
# llamacpp.json. Logs and JSON go to OUT_DIR; a short table is printed last. Exits non-zero if a
# check failed (benchmarks still run). CHECKS_ONLY=1 stops after the checks.
set -uo pipefail

OUT=${1:?usage: battery.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODELS=${TMPDIR:-/tmp}/strata-battery-models
rm -rf "$MODELS"
mkdir -p "$MODELS" "$OUT/logs"
declare -a TABLE
failed=0

step() { # name, command...
    local name=$1
    shift
    local start=$SECONDS
    if "$@" >>"$OUT/logs/$name.log" 2>&1; then
        TABLE+=("$(printf '%-28s PASS  %4ds' "$name" $((SECONDS - start)))")
    else
        TABLE+=("$(printf '%-28s FAIL  %4ds  (logs/%s.log)' "$name" $((SECONDS - start)) "$name")")
        failed=1
    fi
    tail -n 3 "$OUT/logs/$name.log"
}

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

step node-inspect "$BIN" node inspect
"$BIN" node inspect --json >"$OUT/inventory.json" 2>/dev/null
step kernels-selftest "$BIN" kernels selftest
step nccl-1rank "$BIN" gpu nccl --devices 0 --json "$OUT/nccl.json"

# Synthesized checkpoints covering the four families (GQA, qkv bias, q/k norm, sliding window).
synth() { # name arch extra...
    local name=$1 arch=$2
    shift 2
    "$BIN" model synth --arch "$arch" --out "$MODELS/$name" --layers 4 --hidden 512 \
        --heads 8 --kv-heads 2 --intermediate 1024 --max-position 2048 "$@" >/dev/null
}
synth llama llama --rope-scaling-llama3 8:1:4:1024 --rope-theta 500000
synth qwen3 qwen3 --head-dim 128
synth qwen2 qwen2
synth mistral mistral --sliding-window 48
# The canary: the llama checkpoint read with rope_theta left at the common default 10000 (the
# classic bug of ignoring the config's value); parity must fail on it.
cp -r "$MODELS/llama" "$MODELS/llama-canary"
python3 - "$MODELS/llama-canary/config.json" <<'PY'
import json, sys
path = sys.argv[1]
c = json.load(open(path))
c["rope_theta"] = 10000.0
json.dump(c, open(path, "w"))
PY

for m in llama qwen3 qwen2 mistral; do
    step "parity-$m" "$BIN" gpu parity --model "$MODELS/$m" --json "$OUT/parity-$m.json"
done
if "$BIN" gpu parity --model "$MODELS/llama" --reference-model "$MODELS/llama-canary" \
    --json "$OUT/parity-canary.json" >"$OUT/logs/parity-canary.log" 2>&1; then
    TABLE+=("$(printf '%-28s FAIL  (the canary passed)' parity-canary)")
    failed=1
else
    TABLE+=("$(printf '%-28s PASS  (the canary failed, as it must)' parity-canary)")
fi
# The TP=1 path of tensor parallelism: the engine as the one rank of an NCCL group.
step parity-llama-nccl "$BIN" gpu parity --model "$MODELS/llama" --nccl --json "$OUT/parity-llama-nccl.json"
for m in llama qwen3; do
    step "invariance-$m" "$BIN" gpu invariance --model "$MODELS/$m" --json "$OUT/invariance-$m.json"
done
# Tensor parallelism: ranks holding their slices of the weights (sharing this GPU through the
# host-staged communicator) against one GPU in the shard order, bit for bit; the canary (ranks
# that skip the all-gather) must differ. llama's 2 kv heads shard at TP 2 and are shared at 4, 8.
step tp-llama "$BIN" gpu tp --model "$MODELS/llama" --tp 2,4,8 --json "$OUT/tp-llama.json"
step tp-qwen3 "$BIN" gpu tp --model "$MODELS/qwen3" --tp 2,4 --json "$OUT/tp-qwen3.json"

# The three surfaces served from the GPU.
smoke() {
    local port=18181
    "$BIN" serve --model "$MODELS/qwen3" --device cuda:0 --port $port &
    local pid=$!
    for _ in $(seq 60); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
    local name=qwen3 ok=0
    curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
        -d "{\"model\":\"$name\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":8,\"temperature\":0}" \
        | tee /dev/stderr | grep -q '"finish_reason"' || ok=1
    curl -sf "http://127.0.0.1:$port/v1/messages" -H 'content-type: application/json' \
        -d "{\"model\":\"$name\",\"max_tokens\":8,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" \
        | tee /dev/stderr | grep -q '"stop_reason"' || ok=1
    curl -sf "http://127.0.0.1:$port/model/$name/converse" -H 'content-type: application/json' \
        -d '{"messages":[{"role":"user","content":[{"text":"hi"}]}],"inferenceConfig":{"maxTokens":8}}' \
        | tee /dev/stderr | grep -q '"stopReason"' || ok=1
    kill -TERM $pid
    wait $pid
    return $ok
}
step serve-smoke smoke
# CHECKS_ONLY=1: the gates above without the benchmarks (a few minutes), for a change that
# cannot move a number.
if [[ ${CHECKS_ONLY:-0} == 1 ]]; then
    echo
    echo "== battery (checks only) =="
    printf '%s\n' "${TABLE[@]}"
    exit $failed
fi

# Benchmarks. Decode is also a gate: graph replay must equal eager launches bit for bit.
"$BIN" kernels bench 2>&1 | tee "$OUT/logs/kernels-bench.log"
step decode-graphs "$BIN" gpu decode --config "$BENCH_CONFIG" --profile --json "$OUT/decode.json"
cat "$OUT/logs/decode-graphs.log"
# What the shard order (byte identity across TP degrees) costs at TP = 1.
step decode-sharded "$BIN" gpu decode --config "$BENCH_CONFIG" --sharded --check-graphs 1,33 \
    --json "$OUT/decode-sharded.json"
cat "$OUT/logs/decode-sharded.log"
"$BIN" gpu prefill --config "$BENCH_CONFIG" --json "$OUT/prefill.json" 2>&1 | tee "$OUT/logs/prefill.log"
python3 scripts/device/torch_peer.py "$BENCH_CONFIG" "$OUT/torch.json" 2>&1 | tee "$OUT/logs/torch.log"

PEER_DIR=${PEER_DIR:-.device/peer}
[[ -s $PEER_DIR/llamacpp.json ]] && cp "$PEER_DIR/llamacpp.json" "$OUT/llamacpp.json"

# One receipt with everything measured, the machine and the binary.
python3 - "$OUT" "$BENCH_CONFIG" "$failed" <<'PY'
import glob, json, os, sys
out, config, failed = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
machine = open(os.path.join(out, "machine.txt")).read().split("\n")
receipt = {
    "what": "CUDA backend device battery (scripts/device/battery.sh)",
    "gpu": machine[0], "binary_version": machine[1], "binary_sha256": machine[2].split()[0],
    "git_sha": os.environ.get("STRATA_GIT_SHA", "unknown"),
    "cuda_home": os.environ.get("CUDA_HOME"), "bench_config": json.load(open(config)),
    "checks_passed": not failed,
}
for path in sorted(glob.glob(os.path.join(out, "*.json"))):
    name = os.path.basename(path)[:-5]
    if name != "receipt":
        receipt[name] = json.load(open(path))
json.dump(receipt, open(os.path.join(out, "receipt.json"), "w"), indent=2)
PY
# Few files come back from the device machine: the receipt, the machine, and the rest packed.
(cd "$OUT" && tar -czf logs.tar.gz logs $(ls *.json | grep -v '^receipt.json$') && rm -rf logs \
    $(ls *.json | grep -v '^receipt.json$'))

echo
echo "== battery =="
printf '%s\n' "${TABLE[@]}"
python3 - "$OUT/receipt.json" <<'PY'
import json, sys  # the summary, from the receipt
r = json.load(open(sys.argv[1]))
torch = {d["batch"]: d for d in r.get("torch", {}).get("decode", [])}
lc = r.get("llamacpp", {}).get("summary", {})
nan = float("nan")
for d in r.get("decode", {}).get("results", []):
    t = torch.get(d["batch"], {}).get("tokens_per_s", nan)
    l = lc.get("decode_tok_s", {}).get(str(d["batch"])) or nan
    print(f"decode b={d['batch']:>3}: {d['tokens_per_s']:8.0f} tok/s  {100*d['roofline_fraction']:5.1f} % of roofline  torch {t:8.0f}  llama.cpp {l:8.0f}")
for d in r.get("decode-sharded", {}).get("results", []):
    print(f"decode b={d['batch']:>3} shard order: {d['tokens_per_s']:8.0f} tok/s  {100*d['roofline_fraction']:5.1f} % of roofline")
tp = {d["prompt"]: d for d in r.get("torch", {}).get("prefill", [])}
for d in r.get("prefill", {}).get("results", []):
    t = tp.get(d["prompt"], {}).get("tokens_per_s", nan)
    l = lc.get("prefill_tok_s", {}).get(str(d["prompt"])) or nan
    print(f"prefill {d['prompt']:>5}: {d['tokens_per_s']:8.0f} tok/s  {100*d['peak_fraction']:5.1f} % of bf16 peak  torch {t:8.0f}  llama.cpp {l:8.0f}")
PY
exit $failed
