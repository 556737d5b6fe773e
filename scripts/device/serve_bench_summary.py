#!/usr/bin/env python3
"""serve_bench.sh's receipt and table: reads the raw files a run leaves in OUT_DIR (decode*.json,
bench-*.json, ready-*.json, machine.txt, logs/metrics-*.txt, logs/util-*.txt), writes
OUT_DIR/receipt.json and prints each arm's served rates against its own microbenchmark.

    serve_bench_summary.py OUT_DIR FAILED(0|1)

CI runs it on a real run's files (tests/battery_summaries.rs), so the GPU machine never finds it
broken.
"""
import glob, json, os, re, sys
out, failed = sys.argv[1], sys.argv[2] == "1"
machine = open(os.path.join(out, "machine.txt")).read().split("\n")
def metrics(path):
    values = {}
    for line in open(path):
        # Every strata_ sample carries model_name first; keyed without it.
        line = re.sub(r'model_name="[^"]*",?', "", line).replace("{}", "")
        m = re.match(r'^(strata_engine_[a-z_]+(?:\{phase="\w+"\})?) ([0-9.e+-]+)$', line.strip())
        if m:
            values[m.group(1)] = float(m.group(2))
    return values
receipt = {
    "what": "Serving under load on the GPU (scripts/device/serve_bench.sh)",
    "gpu": machine[0], "binary_version": machine[1], "binary_sha256": machine[2].split()[0],
    "git_sha": os.environ.get("STRATA_GIT_SHA", "unknown"), "checks_passed": not failed,
    "decode": json.load(open(os.path.join(out, "decode.json"))) if os.path.exists(os.path.join(out, "decode.json")) else None,
    "decode_baseline": json.load(open(os.path.join(out, "decode-baseline.json"))) if os.path.exists(os.path.join(out, "decode-baseline.json")) else None,
    "decode_run_order": json.load(open(os.path.join(out, "decode-runorder.json"))) if os.path.exists(os.path.join(out, "decode-runorder.json")) else None,
    "invariance_run_order": json.load(open(os.path.join(out, "invariance-runorder.json"))) if os.path.exists(os.path.join(out, "invariance-runorder.json")) else None,
    "serve": {},
}
for path in sorted(glob.glob(os.path.join(out, "ready-*.json"))):
    r = json.load(open(path))
    receipt["serve"].setdefault(r["name"], {})["ready_s"] = r["ready_s"]
for path in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    name, label = os.path.basename(path)[6:-5].split("-", 1)
    bench = json.load(open(path))
    logs = os.path.join(out, "logs")
    before = metrics(os.path.join(logs, f"metrics-{name}-{label}-before.txt"))
    after = metrics(os.path.join(logs, f"metrics-{name}-{label}-after.txt"))
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = delta.get("strata_engine_steps_total", 0.0)
    phases = {p: delta.get(f'strata_engine_step_seconds_total{{phase="{p}"}}', 0.0) for p in ("plan", "forward", "sample")}
    util = [float(x) for x in open(os.path.join(logs, f"util-{name}-{label}.txt")).read().split() if x.strip().isdigit()]
    receipt["serve"].setdefault(name, {})[label] = {
        "bench": bench,
        "engine_steps": steps,
        "step_ms_by_phase": {p: 1e3 * s / steps if steps else None for p, s in phases.items()},
        "gpu_utilization_mean_pct": sum(util) / len(util) if util else None,
        "gpu_utilization_samples": len(util),
    }
json.dump(receipt, open(os.path.join(out, "receipt.json"), "w"), indent=2)

print("\n== serving under load ==")
micro = {
    "new": {d["batch"]: d for d in (receipt["decode"] or {}).get("results", [])},
    "runorder": {d["batch"]: d for d in (receipt["decode_run_order"] or {}).get("results", [])},
}
for name, arms in receipt["serve"].items():
    # Each arm against the microbenchmark of its own kernels.
    decode = micro.get(name) or micro["new"]
    print(f"[{name}] ready in {arms.get('ready_s')} s")
    for label, r in arms.items():
        if not isinstance(r, dict):
            continue
        for p in r["bench"].get("points", []):
            c = p.get("concurrency")
            # (not `micro`: that name holds every arm's microbenchmark for the next arm)
            micro_tps = decode.get(c, {}).get("tokens_per_s")
            step = decode.get(c, {}).get("step_ms", {}).get("median")
            ratio = f"{p['output_tok_s'] / micro_tps:5.2f}" if micro_tps else "  -  "
            ph = r["step_ms_by_phase"]
            fmt = lambda v: f"{v:6.2f}" if v is not None else "   -  "
            print(f"  {label:<11} out {p['output_tok_s']:8.0f} tok/s  vs micro {ratio}  "
                  f"TTFT p50 {p['ttft_ms']['p50']:8.1f} p99 {p['ttft_ms']['p99']:8.1f}  "
                  f"ITL p50 {p['itl_ms']['p50']:6.1f} (step {step if step else float('nan'):6.2f})  "
                  f"GPU {r['gpu_utilization_mean_pct'] or float('nan'):5.1f} %  "
                  f"plan/fwd/sample ms {fmt(ph['plan'])} {fmt(ph['forward'])} {fmt(ph['sample'])}")
