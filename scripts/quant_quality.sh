#!/usr/bin/env bash
# Quality of every `strata quantize` plan on a real model, on the CPU reference:
#   scripts/quant_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]
# MODEL (an HF directory or a GGUF file) is the baseline as the reference reads it (a GGUF's
# blocks widened exactly); each plan quantizes it (strata quantize) and is compared with it on
# TEXT by `strata eval compare` (llama.cpp's perplexity positions): both perplexities, the mean
# and largest KL(baseline ‖ plan) and the top-1 agreement. Writes OUT_DIR/receipt.json: per plan
# those, the perplexity ratio, the mean and worst relative RMS error of its Linear projections,
# and the weights' bytes.
set -euo pipefail
model=${1:?usage: quant_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]}
text=${2:?text}
out=${3:?out dir}
context=${4:-512}
chunks=${5:-8}
bin=${STRATA:-target/release/strata}
mkdir -p "$out"
for plan in fp8 fp8-block nvfp4 nvfp4-4o6 mixed; do
    rm -rf "$out/$plan"
    "$bin" quantize --plan "$plan" --model "$model" --out "$out/$plan" >"$out/$plan.quantize.txt"
    tail -1 "$out/$plan.quantize.txt"
    "$bin" eval compare --model "$model" --candidate "$out/$plan" --text "$text" \
        --context "$context" --max-chunks "$chunks" --json "$out/$plan.json" 2>/dev/null |
        tee "$out/$plan.txt"
done
python3 - "$out" "$model" "$bin" <<'PY'
import json, pathlib, re, subprocess, sys
out, model, binary = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
plans = {}
base = None
for plan in ("fp8", "fp8-block", "nvfp4", "nvfp4-4o6", "mixed"):
    p = json.loads((out / f"{plan}.json").read_text())
    base = base or {"perplexity": p["reference_perplexity"], "text": p["text"], "context": p["context"],
                    "chunks": p["chunks"], "scored_tokens": p["scored_tokens"]}
    errors = [float(m.group(1)) for m in re.finditer(r"relative RMS error ([0-9.e+-]+)", (out / f"{plan}.quantize.txt").read_text())]
    plans[plan] = {
        "perplexity": p["candidate_perplexity"],
        "perplexity_ratio_to_baseline": p["candidate_perplexity"] / p["reference_perplexity"],
        "mean_kl_nats": p["mean_kl"],
        "max_kl_nats": p["max_kl"],
        "top1_agreement": p["top1_agreement"],
        "linear_relative_rms_error_mean": sum(errors) / len(errors),
        "linear_relative_rms_error_worst": max(errors),
        "weights_bytes": (out / plan / "model.safetensors").stat().st_size,
    }
git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
receipt = {
    "what": "strata quantize plans scored by strata eval perplexity on the CPU reference",
    "git": git, "binary": binary, "model": model, "text": base["text"],
    "context": base["context"], "chunks": base["chunks"], "scored_tokens": base["scored_tokens"],
    "baseline": {"perplexity": base["perplexity"]},
    "plans": plans,
}
(out / "receipt.json").write_text(json.dumps(receipt, indent=2) + "\n")
print(f"{'plan':<10} {'perplexity':>10} {'ratio':>7} {'KL':>8} {'top-1':>7} {'rms err':>8}")
print(f"{'baseline':<10} {base['perplexity']:>10.4f}")
for name, p in plans.items():
    print(f"{name:<10} {p['perplexity']:>10.4f} {p['perplexity_ratio_to_baseline']:>7.4f} "
          f"{p['mean_kl_nats']:>8.4f} {p['top1_agreement']:>7.4f} {p['linear_relative_rms_error_mean']:>8.4f}")
PY
