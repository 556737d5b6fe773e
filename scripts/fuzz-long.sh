#!/usr/bin/env bash
# The recorded fuzz runs (docs/TESTING.md, "Fuzzing"): every fuzz target for ten minutes, two at
# a time, in the test profile (debug assertions on, so an arithmetic overflow is a crash), then
# their receipt lines gathered into docs/receipts/fuzz-long.json (or the path given). CI runs the
# same targets bounded, as ordinary tests; this is the long run whose receipt is committed.
# Usage: scripts/fuzz-long.sh [RECEIPT [PARALLEL]]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
receipt=${1:-docs/receipts/fuzz-long.json}
parallel=${2:-2}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

# package, test binary, ignored test
targets=(
    "strata-model input_fuzz tokenizer_files_for_ten_minutes"
    "strata-model input_fuzz chat_templates_for_ten_minutes"
    "strata-model input_fuzz grammars_for_ten_minutes"
    "strata-model gguf_fuzz gguf_headers_for_ten_minutes"
    "strata-model checkpoint_fuzz checkpoints_for_ten_minutes"
    "strata-node disk_tier_fuzz disk_tier_for_ten_minutes"
    "strata-router bad_input surface_requests_for_ten_minutes"
    "strata-topology quic topology_calls_for_ten_minutes"
    "strata cluster_serving node_calls_for_ten_minutes"
)

scripts/fetch-test-data.sh
for target in "${targets[@]}"; do
    read -r package binary _ <<<"$target"
    cargo test --locked -p "$package" --test "$binary" --no-run
done

run_one() {
    read -r package binary test <<<"$1"
    if cargo test --locked -q -p "$package" --test "$binary" -- --ignored --exact "$test" \
        --nocapture >"$2/$test.log" 2>&1; then
        echo "passed: $test" >&2
    else
        echo "FAILED: $test (its log follows)" >&2
        tail -n 40 "$2/$test.log" >&2
        return 1
    fi
}
export -f run_one
status=0
printf '%s\n' "${targets[@]}" | xargs -P "$parallel" -I{} bash -c 'run_one "$1" "$2"' _ {} "$logs" \
    || status=$?

python3 - "$logs" "$receipt" "$status" "$parallel" <<'EOF'
import json, os, platform, subprocess, sys
logs, receipt, status, parallel = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
targets = []
for name in sorted(os.listdir(logs)):
    for line in open(os.path.join(logs, name), errors="replace"):
        if line.startswith("FUZZ-RECEIPT "):
            entry = json.loads(line[len("FUZZ-RECEIPT "):])
            entry["test"] = name.removesuffix(".log")
            targets.append(entry)
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip() != ""
doc = {
    "what": "every fuzz target for ten minutes (scripts/fuzz-long.sh); seeded mutation campaigns, "
            "test profile with debug assertions; a crash, a hang or a failed check fails its test",
    "commit": commit + ("+uncommitted" if dirty else ""),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
    "parallel": parallel,
    "all_passed": status == 0,
    "total_cases": sum(t["cases"] for t in targets),
    "targets": targets,
}
with open(receipt, "w") as f:
    json.dump(doc, f, indent=2)
    f.write("\n")
print(f"{len(targets)} targets, {doc['total_cases']} cases -> {receipt}", file=sys.stderr)
EOF
exit "$status"
