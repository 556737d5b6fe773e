#!/usr/bin/env bash
# CPU serving, a baseline binary against the current one on the demo model (issue 17's "no
# regression on the CPU"): each binary serves the random-weight demo model in turn and
# `strata bench serve` drives it at concurrency 1 / 4 / 16 (64-token prompts, 32 output tokens),
# twice in opposite orders; the receipt holds both runs and the after/before ratios.
#   scripts/bench/cpu-serve.sh BASE_BIN BASE_SERVE_ARGS NEW_BIN NEW_SERVE_ARGS OUT_DIR
# (SERVE_ARGS pick the demo model: `--random-model` on current binaries, nothing on older ones.)
set -euo pipefail
BASE=$1 BASE_ARGS=$2 NEW=$3 NEW_ARGS=$4 OUT=$5
PORT=${PORT:-18300}
mkdir -p "$OUT"

run() { # label binary args out
    local label=$1 bin=$2 args=$3 out=$4
    # shellcheck disable=SC2086
    "$bin" serve --port "$PORT" $args >"$OUT/$label.log" 2>&1 &
    local server=$!
    for _ in $(seq 240); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
        sleep 0.5
    done
    "$NEW" bench serve --url "http://127.0.0.1:$PORT" --concurrency 1,4,16 --num-prompts 16 \
        --input-len 64 --output-len 32 --vocab-size 320 --label "$label" --json "$out" \
        >>"$OUT/bench.log" 2>&1
    kill "$server"
    wait "$server" 2>/dev/null || true
}

run base-1 "$BASE" "$BASE_ARGS" "$OUT/base-first-base.json"
run new-1 "$NEW" "$NEW_ARGS" "$OUT/base-first-new.json"
run new-2 "$NEW" "$NEW_ARGS" "$OUT/new-first-new.json"
run base-2 "$BASE" "$BASE_ARGS" "$OUT/new-first-base.json"

python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
load = lambda n: json.loads((out / n).read_text())
runs = []
for order, base, new in (("base first", "base-first-base", "base-first-new"),
                         ("new first", "new-first-base", "new-first-new")):
    b, n = load(base + ".json"), load(new + ".json")
    runs.append({"order": order, "points": [
        {"concurrency": pb["concurrency"], "before_out_tok_s": pb["output_tok_s"],
         "after_out_tok_s": pn["output_tok_s"], "ratio": pn["output_tok_s"] / pb["output_tok_s"]}
        for pb, pn in zip(b["points"], n["points"])], "before": b, "after": n})
mean = {p["concurrency"]: sum(r["points"][i]["ratio"] for r in runs) / len(runs)
        for i, p in enumerate(runs[0]["points"])}
receipt = {"runs": runs, "mean_ratio_after_over_before": mean}
(out / "receipt.json").write_text(json.dumps(receipt, indent=1))
print("after / before, mean of both orders:", {k: round(v, 3) for k, v in mean.items()})
PY
