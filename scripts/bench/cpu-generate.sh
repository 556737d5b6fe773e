#!/usr/bin/env bash
# Benchmarks `strata generate` (CPU reference) on the ~100M demo model and writes a receipt.
# Usage: scripts/bench/cpu-generate.sh [RUNS] [RECEIPT]   (release binary built beforehand)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
runs=${1:-5}
receipt=${2:-$root/docs/receipts/cpu-generate-demo-100m.json}
bin=$root/target/release/strata
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
prompt="The reference engine of strata runs every supported architecture on any machine; this prompt is long enough to measure prefill as well as decode on two cores, which is what the continuous integration machines have."
cmd=("$bin" generate --cache-dir "$cache" --prompt "$prompt" --max-tokens 128)
"${cmd[@]}" >/dev/null 2>&1   # synthesizes the demo model, warms the page cache
# The memory ceiling of this machine, as bytes moved (read + written) by a large memcpy.
memcpy=$( (perf bench mem memcpy -s 512MB -l 3 2>/dev/null || true) | awk '/GB\/sec/ {print $1}' | tail -1)
log=$(mktemp)
for _ in $(seq "$runs"); do "${cmd[@]}" 2>&1 >/dev/null | tail -1 >>"$log"; done
python3 - "$log" "$receipt" "$bin" "$cache" "$runs" "${cmd[*]}" "${memcpy:-}" <<'PY'
import hashlib, json, os, platform, re, statistics, subprocess, sys
log, receipt, binary, cache, runs, command, memcpy = sys.argv[1:]
rows = [l for l in open(log) if "decode" in l]
prefill = [float(re.search(r"\(([\d.]+) tok/s prefill\)", l).group(1)) for l in rows]
decode = [float(re.search(r"decode ([\d.]+) tok/s", l).group(1)) for l in rows]
model = os.path.join(cache, "models", "strata-demo-llama-100m-random")
config = json.load(open(os.path.join(model, "config.json")))
weights_bytes = os.path.getsize(os.path.join(model, "model.safetensors"))
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "unknown")
stat = lambda xs: {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "runs": xs}
med = statistics.median(decode)
out = {
    "what": "strata generate on the CPU reference, ~100M-parameter demo model (bf16 weights), 128 new tokens, greedy",
    "git_sha": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "binary_sha256": hashlib.sha256(open(binary, "rb").read()).hexdigest(),
    "machine": {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine()},
    "model": {"name": "strata-demo-llama-100m-random", "config": config, "weights_bytes": weights_bytes},
    "command": command.replace(cache, "$CACHE").replace(os.path.dirname(os.path.dirname(os.path.dirname(binary))) + "/", ""),
    "prefill_tokens_per_s": stat(prefill),
    "decode_tokens_per_s": stat(decode),
    "decode_weight_bandwidth_gb_s": round(med * weights_bytes / 1e9, 2),
    "memcpy_traffic_gb_s": round(2 * float(memcpy), 2) if memcpy else None,
    "note": "each decode step streams every weight once; decode_weight_bandwidth_gb_s = median decode tok/s x weight bytes; memcpy_traffic_gb_s = bytes read + written per second by `perf bench mem memcpy -s 512MB` (one thread), the machine's memory ceiling as measured here",
}
if out["memcpy_traffic_gb_s"]:
    out["decode_fraction_of_memcpy_traffic"] = round(out["decode_weight_bandwidth_gb_s"] / out["memcpy_traffic_gb_s"], 3)
json.dump(out, open(receipt, "w"), indent=1)
print(f"prefill median {statistics.median(prefill):.1f} tok/s, decode median {med:.1f} tok/s "
      f"({out['decode_weight_bandwidth_gb_s']} GB/s of weights) -> {receipt}")
PY
rm -f "$log"
