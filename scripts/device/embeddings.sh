#!/usr/bin/env bash
# Embeddings on the GPU machine, with the carried release binary:
#   scripts/device/embeddings.sh OUT_DIR
# The cases of tests/oracle/embedding_cases.json are synthesized by the binary and served by
# `strata serve --device cuda:0` and `--device cpu`; every prompt's /v1/embeddings vector (token
# ids in, floats out) is compared by cosine similarity between the two (bf16 on the GPU: at least
# 0.999 is required) and with the committed transformers fixture (tests/oracle/fixtures).
# Writes OUT_DIR/receipt.json; exits non-zero if a check failed.
set -uo pipefail

OUT=${1:?usage: embeddings.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CKPTS=${TMPDIR:-/tmp}/strata-embed-ckpts
mkdir -p "$OUT/logs"
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

rm -rf "$CKPTS"
"$BIN" model synth --cases tests/oracle/embedding_cases.json --out "$CKPTS" >"$OUT/logs/synth.log" 2>&1 ||
    { echo "synth FAILED"; cat "$OUT/logs/synth.log"; exit 1; }

serve() { # name port device
    "$BIN" serve --model "$CKPTS/qwen3-embedding" --device "$3" --port "$2" \
        >>"$OUT/logs/serve-$1.log" 2>&1 &
    eval "$1=$!"
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$2/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "serve ($1) did not come up"
    tail -20 "$OUT/logs/serve-$1.log"
    return 1
}
serve gpu 18291 cuda:0 || exit 1
serve cpu 18292 cpu || exit 1

python3 - "$OUT" <<'PY'
import json, math, pathlib, sys, urllib.request
from safetensors.numpy import load_file
out = pathlib.Path(sys.argv[1])
case = json.loads(pathlib.Path("tests/oracle/embedding_cases.json").read_text())["cases"][0]
fixture = load_file(f"tests/oracle/fixtures/{case['name']}.safetensors")
def embed(port, prompts):
    body = json.dumps({"model": case["name"], "input": prompts, "encoding_format": "float"}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/embeddings", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [d["embedding"] for d in json.loads(r.read())["data"]]
def cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
gpu, cpu = embed(18291, case["prompts"]), embed(18292, case["prompts"])
rows, ok = [], True
for i, (g, c) in enumerate(zip(gpu, cpu)):
    hf = fixture[f"prompt{i}.last"].tolist()
    row = {"prompt": i, "tokens": len(case["prompts"][i]),
           "cos_gpu_cpu": cos(g, c), "cos_cpu_hf": cos(c, hf), "cos_gpu_hf": cos(g, hf)}
    ok &= row["cos_gpu_cpu"] >= 0.999 and row["cos_cpu_hf"] >= 0.999999
    rows.append(row)
    print("  ".join(f"{k}={v:.6f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
(out / "receipt.json").write_text(json.dumps({
    "machine": (out / "machine.txt").read_text().splitlines(),
    "case": case["name"], "spec": case["spec"], "pooling": "last, normalized",
    "rows": rows, "passed": ok}, indent=2))
print("embeddings GPU vs CPU vs transformers:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
status=$?
kill "$gpu" "$cpu" 2>/dev/null
wait 2>/dev/null
exit $status
