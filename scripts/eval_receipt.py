#!/usr/bin/env python3
"""A receipt from `strata eval compare` runs: OUT/<arm>.json for each arm (the baseline is their
common reference), plus, where the run left them, the arm's Linear reconstruction errors
(OUT/<arm>.quantize.txt, `strata quantize`'s output) and its weights' bytes
(OUT/<arm>/model.safetensors). Writes OUT/receipt.json and prints a table.

Used by scripts/quant_quality.sh and scripts/activation_quality.sh.
"""

import argparse
import json
import pathlib
import re
import subprocess


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--binary", required=True)
    parser.add_argument("--what", required=True)
    parser.add_argument("--group", default="arms", help="the receipt's key for the arms")
    parser.add_argument("--note", action="append", default=[], metavar="KEY=VALUE",
                        help="a further top-level field of the receipt")
    parser.add_argument("arms", nargs="+")
    args = parser.parse_args()
    out = args.out
    arms, base = {}, None
    for arm in args.arms:
        p = json.loads((out / f"{arm}.json").read_text())
        base = base or {"perplexity": p["reference_perplexity"], "text": p["text"],
                        "context": p["context"], "chunks": p["chunks"],
                        "scored_tokens": p["scored_tokens"]}
        entry = {
            "perplexity": p["candidate_perplexity"],
            "perplexity_ratio_to_baseline": p["candidate_perplexity"] / p["reference_perplexity"],
            "mean_kl_nats": p["mean_kl"],
            "max_kl_nats": p["max_kl"],
            "top1_agreement": p["top1_agreement"],
        }
        greedy = p.get("greedy")
        if greedy:
            entry["greedy"] = {k: greedy[k] for k in (
                "tokens", "prompts", "prompt_tokens", "identical", "mean_shared_prefix",
                "positional_agreement", "divergence_margins")}
        quantized = out / f"{arm}.quantize.txt"
        if quantized.exists():
            errors = [float(m.group(1)) for m in
                      re.finditer(r"relative RMS error ([0-9.e+-]+)", quantized.read_text())]
            entry["linear_relative_rms_error_mean"] = sum(errors) / len(errors)
            entry["linear_relative_rms_error_worst"] = max(errors)
        weights = out / arm / "model.safetensors"
        if weights.exists():
            entry["weights_bytes"] = weights.stat().st_size
        arms[arm] = entry
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    receipt = {"what": args.what, "git": git, "binary": args.binary, "model": args.model,
               "text": base["text"]}
    receipt.update(dict(note.split("=", 1) for note in args.note))
    receipt.update({"context": base["context"], "chunks": base["chunks"],
                    "scored_tokens": base["scored_tokens"],
                    "baseline": {"perplexity": base["perplexity"]}, args.group: arms})
    (out / "receipt.json").write_text(json.dumps(receipt, indent=2) + "\n")
    rms = all("linear_relative_rms_error_mean" in a for a in arms.values())
    greedy = all("greedy" in a for a in arms.values())
    print(f"{'arm':<12} {'perplexity':>10} {'ratio':>7} {'KL':>8} {'top-1':>7}"
          + (f" {'rms err':>8}" if rms else "")
          + (f" {'greedy same':>11} {'prefix':>6}" if greedy else ""))
    print(f"{'baseline':<12} {base['perplexity']:>10.4f}")
    for name, a in arms.items():
        g = a.get("greedy")
        print(f"{name:<12} {a['perplexity']:>10.4f} {a['perplexity_ratio_to_baseline']:>7.4f} "
              f"{a['mean_kl_nats']:>8.4f} {a['top1_agreement']:>7.4f}"
              + (f" {a['linear_relative_rms_error_mean']:>8.4f}" if rms else "")
              + (f" {g['identical']:>5}/{g['prompts']:<5} {g['mean_shared_prefix']:>6.1f}"
                 if greedy else ""))


if __name__ == "__main__":
    main()
