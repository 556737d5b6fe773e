#!/usr/bin/env python3
"""Loads checkpoints written by `strata quantize` in transformers (through compressed-tensors) and
keeps the weights transformers dequantizes them to.

Usage (torch, transformers and compressed-tensors installed; no GPU is needed):
    strata model synth --cases tests/oracle/quant/cases.json --out CKPTS
    for p in fp8 fp8-block nvfp4 nvfp4-4o6 mixed; do
        strata quantize --plan $p --model CKPTS/qwen3-quant --out QUANT/$p
    done
    python3 tests/oracle/quant/check_strata_quantize.py --quantized QUANT --out tests/oracle/quant

Writes OUT/strata-<plan>.dequantized.safetensors (every Linear's weight as transformers holds it
after decompressing, bf16). model/tests/quantized.rs quantizes the same synthesized model again
and requires strata's own reading of its files to equal these bit for bit. transformers applies one
scheme to every dense layer of a mixed config (its integration tells dense layers from MoE experts
only), so a `mixed` checkpoint is decompressed module by module with compressed-tensors' own
compressors, each module under the config group its name matches.
"""

import argparse
import json
import pathlib
import re

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import CompressedTensorsConfig


def per_module(plan_dir):
    """Each Linear of the checkpoint decompressed by compressed-tensors' compressor for its group."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = json.loads((plan_dir / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(plan_dir / "model.safetensors"))
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(("weight_scale", "weight_packed"))})
    out = {}
    for module in modules:
        group = next(g for g in config["config_groups"].values()
                     if any(re.match(t[3:], module) for t in g["targets"] if t.startswith("re:")))
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        state = {n[len(module) + 1:]: t for n, t in tensors.items() if n.startswith(module + ".")}
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        out[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].to(torch.bfloat16).contiguous()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for plan_dir in sorted(p for p in args.quantized.iterdir() if p.is_dir()):
        config = json.loads((plan_dir / "config.json").read_text())["quantization_config"]
        if config["format"] == "mixed-precision":
            weights = per_module(plan_dir)
            loader = "compressed-tensors' compressors, module by module"
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                plan_dir,
                dtype=torch.bfloat16,
                quantization_config=CompressedTensorsConfig(dequantize=True),
            )
            weights = {
                f"{name}.weight": module.weight.data.to(torch.bfloat16).contiguous()
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
            }
            loader = "transformers"
        meta = {"transformers": transformers.__version__, "torch": torch.__version__,
                "compressed_tensors": __import__("compressed_tensors").__version__, "plan": plan_dir.name,
                "loader": loader}
        path = args.out / f"strata-{plan_dir.name}.dequantized.safetensors"
        save_file(weights, str(path), metadata=meta)
        print(f"{path}: {len(weights)} Linear weights as {loader} dequantized {plan_dir}")


if __name__ == "__main__":
    main()
