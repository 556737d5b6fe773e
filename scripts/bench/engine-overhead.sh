#!/usr/bin/env bash
# Runs the engine-overhead benchmark (scheduler + block manager + prefix index + KV events, no
# model math) and writes its receipt.
# Usage: scripts/bench/engine-overhead.sh [RECEIPT]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
receipt=${1:-$root/docs/receipts/engine-overhead.json}
cd "$root"
cmd=(cargo bench -p strata-node --bench engine_overhead --quiet)
# The executable cargo runs, from the build's JSON messages (building now makes the run below a
# no-op build, so the figures are not taken while compiling).
bin=$(cargo bench -p strata-node --bench engine_overhead --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "engine_overhead" and m.get("executable"):
        print(m["executable"])
')
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"${cmd[@]}" >"$out"
python3 - "$out" "$receipt" "$bin" "${cmd[*]}" <<'PY'
import datetime, hashlib, json, os, subprocess, sys
out, receipt, binary, command = sys.argv[1:]
report = json.load(open(out))
head = {
    "what": "engine overhead with a null backend: scheduler decode step, prefix index, KV event log",
    "git_sha": subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip(),
    "git_dirty": bool(subprocess.check_output(["git", "status", "--porcelain"], text=True).strip()),
}
if binary and os.path.isfile(binary):
    head["binary"] = os.path.relpath(binary)
    head["binary_sha256"] = hashlib.sha256(open(binary, "rb").read()).hexdigest()
else:
    head["binary_sha256_note"] = "bench executable not found in cargo's build output"
head["command"] = command
head["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
head.update(report)
os.makedirs(os.path.dirname(receipt), exist_ok=True)
with open(receipt, "w") as f:
    json.dump(head, f, indent=1)
    f.write("\n")
print(f"wrote {receipt}", file=sys.stderr)
PY
