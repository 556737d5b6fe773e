#!/usr/bin/env bash
# Runs one `harness = false` cargo bench that prints a JSON object, and writes it as a receipt
# with the git sha, the bench executable's hash, the command and the date.
# Usage: scripts/bench/cargo-bench-receipt.sh PACKAGE BENCH "WHAT" RECEIPT
set -euo pipefail
package=${1:?package} bench=${2:?bench} what=${3:?what} receipt=${4:?receipt}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
cmd=(cargo bench -p "$package" --bench "$bench" --quiet)
# The executable cargo runs, from the build's JSON messages (building now makes the run below a
# no-op build, so the figures are not taken while compiling).
bin=$(cargo bench -p "$package" --bench "$bench" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])
' "$bench")
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"${cmd[@]}" >"$out"
python3 - "$out" "$receipt" "$bin" "${cmd[*]}" "$what" <<'PY'
import datetime, hashlib, json, os, subprocess, sys
out, receipt, binary, command, what = sys.argv[1:]
report = json.load(open(out))
head = {
    "what": what,
    "git_sha": subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip(),
    "git_dirty": bool(subprocess.check_output(["git", "status", "--porcelain"], text=True).strip()),
}
if binary and os.path.isfile(binary):
    head["binary"] = os.path.relpath(binary)
    head["binary_sha256"] = hashlib.sha256(open(binary, "rb").read()).hexdigest()
else:
    head["binary_sha256_note"] = "bench executable not found in cargo's build output"
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
           "unknown") if os.path.exists("/proc/cpuinfo") else "unknown"
head["machine"] = {"cores": os.cpu_count(), "cpu": cpu, "arch": os.uname().machine}
head["command"] = command
head["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
head.update(report)
os.makedirs(os.path.dirname(receipt), exist_ok=True)
with open(receipt, "w") as f:
    json.dump(head, f, indent=1)
    f.write("\n")
print(f"wrote {receipt}", file=sys.stderr)
PY
