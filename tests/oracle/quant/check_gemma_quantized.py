#!/usr/bin/env python3
"""Loads the FP8 checkpoint `strata quantize` writes from the real Gemma 3 GGUF in transformers
(through compressed-tensors) and keeps its logits: the Gemma 3 config strata writes (sliding and
global layers, two rope bases, query scalar, activation) and its norms (the GGUF stores `1 + w`,
the written checkpoint `w`) are read by transformers as strata reads them.

Usage (torch, transformers and compressed-tensors installed; no GPU is needed):
    strata quantize --plan fp8 --model target/test-data/models/gemma-3-270m-q4_k_m.gguf --out Q
    python3 tests/oracle/quant/check_gemma_quantized.py --quantized Q \\
        --out tests/oracle/quant/gemma-fp8-logits.json

For each prompt: the token ids transformers' tokenizer gives from the written tokenizer files
(with BOS) and the last position's 32 largest logits (f32 model). model/tests/quantized.rs
quantizes the same GGUF again and compares strata's tokens and logits with these.
"""

import argparse
import json
import pathlib

import compressed_tensors
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

PROMPTS = [
    "The capital of France is",
    "To be, or not to be, that is the question:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    model = AutoModelForCausalLM.from_pretrained(
        args.quantized, dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(run_compressed=False))
    model.eval()
    cases = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 32)
            cases.append({"prompt": prompt, "tokens": ids,
                          "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()})
    args.out.write_text(json.dumps({
        "source": "transformers loading `strata quantize --plan fp8` of gemma-3-270m-q4_k_m.gguf",
        "transformers": transformers.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
