#!/usr/bin/env bash
# Cross-node KV fetch between two CUDA nodes on the GPU machine: a raft group, two
# `strata node serve --device cuda:0` (both on one GPU, each its own process and KV pool) and a
# round-robin router (deploy/local/up.sh). Each long prompt is computed on one node, then sent to
# the other, which fetches its blocks from the first (or, in the canary arm, computes them).
# Three arms: `auto` (the default cost model decides, from the rates the nodes measure),
# `forced` (a routing config that always fetches: the fetch path's own speed) and `compute`
# (--kv-fetch false, the canary). Checks: every second answer's greedy text equals the first's;
# it found cached prompt tokens when forced (all of them, or those imported before the node's
# 2 s fetch timeout) and none without fetching. Records both
# latencies, the fetches the router asked for and the rates the nodes measured of themselves
# (tokens/s of prefill-heavy steps, bytes/s of fetches).
#
# The model has the Llama-3.1-8B KV shape (32 layers, 8 KV heads of 128: 2 MiB per 16-token
# block in bf16) on a small body (hidden 1024), so that the bytes moved are an 8B's while the
# nodes start in seconds.
#
# Usage: scripts/device/kv_fetch.sh OUT  (STRATA=path/to/strata, default .device/strata)
set -euo pipefail
OUT=${1:?output directory}
export STRATA=${STRATA:-.device/strata}
export STRATA_UP_WAIT_S=${STRATA_UP_WAIT_S:-300}
mkdir -p "$OUT"
model=$OUT/model
"$STRATA" model synth --arch llama --out "$model" --layers 32 --hidden 1024 --heads 8 \
    --kv-heads 8 --head-dim 128 --intermediate 2048 --max-position 8192 >/dev/null

arm() { # name base-port router-args
    local name=$1 base=$2 dir=$OUT/$1
    deploy/local/up.sh --nodes 2 --routers 1 --model "$model" --dir "$dir" --base-port "$base" \
        --node-args "--device cuda:0 --kv-cache-mib 8192" \
        --router-args "--policy round-robin $3" >"$OUT/$name-up.log" 2>&1 ||
        { cat "$OUT/$name-up.log"; tail -50 "$dir"/*.log; return 1; }
    python3 - "http://127.0.0.1:$((base + 101))" "$OUT/$name.json" "$name" <<'PY'
import json, sys, time, urllib.request
base, out, name = sys.argv[1:]
def post(body):
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        v = json.load(r)
    return v, time.perf_counter() - t
rows = []
for i in range(5):
    prompt = [(i * 7919 + j * 31) % 250 + 3 for j in range(4096)]
    body = {"model": "model", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first, t1 = post(body)
    time.sleep(1.0)  # the first node's KV events reach the router
    second, t2 = post(body)
    rows.append({
        "prompt_tokens": second["usage"]["prompt_tokens"],
        "first_s": t1, "second_s": t2,
        "second_cached_tokens": second["usage"]["prompt_tokens_details"]["cached_tokens"],
        "same_text": first["choices"][0]["text"] == second["choices"][0]["text"],
    })
time.sleep(0.3)
metrics = urllib.request.urlopen(base + "/metrics").read().decode()
rates = [l for l in metrics.splitlines()
         if l.startswith(("strata_router_node_tokens_per_second{",
                          "strata_router_node_fetch_bytes_per_second{",
                          "strata_router_kv_fetch"))]
json.dump({"arm": name, "rows": rows, "metrics": rates}, open(out, "w"), indent=1)
print(json.dumps({"arm": name, "rows": rows, "metrics": rates}, indent=1))
PY
    deploy/local/down.sh --dir "$dir" >/dev/null 2>&1 || true
}
cat >"$OUT/forced.toml" <<'TOML'
[kv_fetch]
measured_rates = false
prefill_tokens_per_s = 100
link_bytes_per_s = 1e12
TOML
arm auto 21000 ""
arm forced 22000 "--routing-config $OUT/forced.toml"
arm compute 23000 "--kv-fetch false"
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
auto, forced, compute = (json.load(open(f"{out}/{a}.json")) for a in ("auto", "forced", "compute"))
ok = (all(r["same_text"] for r in auto["rows"] + forced["rows"] + compute["rows"])
      and all(r["second_cached_tokens"] > 0 for r in forced["rows"])
      and all(r["second_cached_tokens"] == 0 for r in compute["rows"]))
med = lambda arm, k: statistics.median(r[k] for r in arm["rows"][1:])  # the first warms up
import hashlib, os, subprocess
binary = os.environ["STRATA"]
summary = {"what": "Cross-node KV fetch between two CUDA nodes on one H200 (scripts/device/kv_fetch.sh): "
                   "a model with the Llama-3.1-8B KV shape (2 MiB blocks) on a small body, 4096-token prompts",
           "git_sha": os.environ.get("STRATA_GIT_SHA", "unknown"),
           "binary_sha256": hashlib.sha256(open(binary, "rb").read()).hexdigest(),
           "gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip(),
           "checks_passed": ok,
           "second_request_s_median": {a["arm"]: med(a, "second_s") for a in (auto, forced, compute)},
           "first_request_s_median": med(compute, "first_s"),
           "arms": [auto, forced, compute]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if ok else 1)
PY
