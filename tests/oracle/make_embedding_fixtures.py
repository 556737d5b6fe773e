#!/usr/bin/env python3
"""Writes the HF transformers pooled-hidden-state fixtures the engine's embeddings are checked against.

Usage (where torch and transformers are installed; no GPU is needed):
    strata model synth --cases tests/oracle/embedding_cases.json --out CKPTS
    python3 tests/oracle/make_embedding_fixtures.py --checkpoints CKPTS --out tests/oracle/fixtures

For every case it loads CKPTS/<name> with AutoModel (the decoder without its LM head) in float32 with
eager attention, runs each prompt alone as one forward pass, and writes fixtures/<name>.safetensors
holding, per prompt i, `prompt{i}.last` (the last token's `last_hidden_state`, which is after the
model's final norm) and `prompt{i}.mean` (the mean over the prompt's tokens), float32, with metadata
naming the weights' sha256 and the library versions. The committed fixture was made on the CPU
machine with torch 2.15 and transformers 5.23 from the package registry (installed with
`pip install --target`); node/tests/embeddings.rs checks the engine against it.
"""

import argparse
import hashlib
import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=pathlib.Path(__file__).with_name("embedding_cases.json"), type=pathlib.Path)
    parser.add_argument("--checkpoints", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()

    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    for case in json.loads(args.cases.read_text())["cases"]:
        ckpt = args.checkpoints / case["name"]
        model = transformers.AutoModel.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tensors = {}
        with torch.no_grad():
            for i, prompt in enumerate(case["prompts"]):
                ids = torch.tensor([prompt], dtype=torch.long)
                hidden = model(input_ids=ids).last_hidden_state[0]
                tensors[f"prompt{i}.last"] = hidden[-1].contiguous()
                tensors[f"prompt{i}.mean"] = hidden.mean(dim=0).contiguous()
        metadata = {
            "weights_sha256": sha256(ckpt / "model.safetensors"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model_class": type(model).__name__,
        }
        path = args.out / f"{case['name']}.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        print(f"{path}: {len(case['prompts'])} prompts, {type(model).__name__}")


if __name__ == "__main__":
    main()
