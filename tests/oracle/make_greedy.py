#!/usr/bin/env python3
"""Writes transformers' greedy continuations that the CPU reference's are checked against.

Usage (torch and transformers on the CPU suffice):
    strata model synth --cases tests/oracle/cases.json --out CKPTS
    python3 tests/oracle/make_greedy.py --checkpoints CKPTS --out tests/oracle/fixtures/greedy.json

For every case of cases.json it loads CKPTS/<name> with AutoModelForCausalLM in float32 with eager
attention and decodes 64 (--steps) tokens greedily from the case's first prompt through its KV
cache (EOS does not stop it), recording at every step the chosen token and the top-1 minus top-2
logit margin (a divergence of the reference is acceptable only where this margin is a near tie).
The file names the weights' sha256 and the library versions per case.
"""

import argparse
import json
import pathlib

import torch
import transformers

# The same weights digest and float32 / eager loading as the logit fixtures.
from make_fixtures import load, sha256


def greedy(model, prompt, steps):
    tokens, margins = [], []
    ids = torch.tensor([prompt], dtype=torch.long)
    past = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            top = torch.topk(logits, 2)
            nxt = int(top.indices[0])
            tokens.append(nxt)
            margins.append(float(top.values[0] - top.values[1]))
            ids = torch.tensor([[nxt]], dtype=torch.long)
    return tokens, margins


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=pathlib.Path(__file__).with_name("cases.json"), type=pathlib.Path)
    parser.add_argument("--checkpoints", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    result = {}
    for case in json.loads(args.cases.read_text())["cases"]:
        ckpt = args.checkpoints / case["name"]
        model = load(ckpt).eval()
        prompt = case["prompts"][0]
        tokens, margins = greedy(model, prompt, args.steps)
        result[case["name"]] = {
            "weights_sha256": sha256(ckpt / "model.safetensors"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": prompt,
            "tokens": tokens,
            "margins": margins,
        }
        print(f"{case['name']}: {len(tokens)} tokens, smallest margin {min(margins):.3g}")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
