#!/usr/bin/env python3
"""How far bf16 arithmetic alone moves a model's greedy path: HF transformers runs the same GGUF
file in bfloat16 and in float32 on the prompts `strata gpu parity` uses (prompt i: 5 + 7i mod 40
ids, id j = (i * 2654435761 + j * 40503 + 17) mod 4096), greedy, EOS not stopping and not
suppressed, and prints each step's token and top-1 minus top-2 log-probability margin.

A GPU-vs-CPU parity flip at a reference margin that transformers' own bf16 run also loses (or
ties) is a bf16 effect, not a kernel bug: the evidence kept beside a receipt.

Usage (transformers, torch and gguf importable; CPU only):
    python3 tests/oracle/bf16_margins.py --model FILE.gguf --prompt 7:4 --prompt 5:64 --out JSON
"""

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM


def prompt(i, vocab):
    n = 5 + (i * 7) % 40
    span = min(max(vocab, 2), 4096)
    return [(i * 2654435761 + j * 40503 + 17) % span for j in range(n)]


def greedy(model, ids, steps):
    tokens, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            top = torch.topk(logp, 2)
            token = int(top.indices[0])
            tokens.append(token)
            margins.append(float(top.values[0] - top.values[1]))
            out = model(
                torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens, margins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", action="append", required=True, help="INDEX:STEPS")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    folder, name = os.path.split(os.path.abspath(args.model))
    result = {"model": name, "prompts": {}}
    for dtype in [torch.float32, torch.bfloat16]:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=dtype)
        model.eval()
        vocab = model.config.vocab_size
        for spec in args.prompt:
            i, steps = (int(v) for v in spec.split(":"))
            tokens, margins = greedy(model, prompt(i, vocab), steps)
            entry = result["prompts"].setdefault(str(i), {})
            entry[str(dtype).removeprefix("torch.")] = {"tokens": tokens, "margins": margins}
            print(dtype, i, tokens[:8], [round(m, 3) for m in margins[:8]], flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
