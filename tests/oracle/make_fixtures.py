#!/usr/bin/env python3
"""Writes the HF transformers logit fixtures that the CPU reference is checked against.

Usage (where torch and transformers are installed; no GPU is needed):
    strata model synth --cases tests/oracle/cases.json --out CKPTS
    python3 tests/oracle/make_fixtures.py --checkpoints CKPTS --out tests/oracle/fixtures

For every case of cases.json it loads CKPTS/<name> with AutoModelForCausalLM in float32 with eager
attention, runs each prompt as one forward pass, and writes fixtures/<name>.safetensors holding, per
prompt i, `prompt{i}.positions` (int64) and `prompt{i}.logits` (float32, positions x vocab), with
metadata naming the weights' sha256 and the library versions. scripts/device/oracle.sh runs it on
the GPU machine, which has torch and transformers.
"""

import argparse
import hashlib
import json
import pathlib
import sys

import torch
import transformers
from safetensors.torch import save_file


def positions_of(n):
    return sorted({0, 1, n // 2, n - 2, n - 1})


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(path):
    kwargs = {"attn_implementation": "eager"}
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    except TypeError:
        return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=pathlib.Path(__file__).with_name("cases.json"), type=pathlib.Path)
    parser.add_argument("--checkpoints", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = json.loads(args.cases.read_text())["cases"]
    for case in cases:
        ckpt = args.checkpoints / case["name"]
        model = load(ckpt).eval()
        tensors = {}
        with torch.no_grad():
            for i, prompt in enumerate(case["prompts"]):
                ids = torch.tensor([prompt], dtype=torch.long)
                logits = model(input_ids=ids).logits[0].float()
                pos = positions_of(len(prompt))
                tensors[f"prompt{i}.positions"] = torch.tensor(pos, dtype=torch.int64)
                tensors[f"prompt{i}.logits"] = logits[pos].contiguous()
        metadata = {
            "case": case["name"],
            "weights_sha256": sha256(ckpt / "model.safetensors"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "dtype": "float32",
            "attn_implementation": "eager",
        }
        save_file(tensors, str(args.out / f"{case['name']}.safetensors"), metadata=metadata)
        print(f"{case['name']}: {len(case['prompts'])} prompts, transformers {transformers.__version__}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
