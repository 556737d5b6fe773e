#!/usr/bin/env python3
"""Quantized checkpoints written by compressed-tensors, and the weights it dequantizes them to.

Usage (torch, transformers and compressed-tensors installed; no GPU is needed):
    strata model synth --cases tests/oracle/quant/cases.json --out CKPTS
    python3 tests/oracle/quant/make_compressed_tensors.py --checkpoints CKPTS --out tests/oracle/quant

For every scheme below it loads CKPTS/qwen3-quant (bf16), attaches the scheme with
compressed-tensors' `apply_quantization_config`, sets each Linear's scales from its weight with the
library's own `calculate_qparams` / `generate_gparam` (min-max, the observer llm-compressor uses by
default), compresses with the library's `ModelCompressor` and saves the checkpoint as
OUT/ct-<scheme>/ (config.json with its `quantization_config`, model.safetensors). It then
decompresses the same model with the library and writes OUT/ct-<scheme>.dequantized.safetensors:
every quantized Linear's weight as compressed-tensors dequantizes it (bf16), which strata's
loader must reproduce bit for bit (model/tests/quantized.rs).
"""

import argparse
import json
import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

SCHEMES = {
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)),
    "fp8-block": ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[32, 32], symmetric=True, dynamic=False)),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)),
    "nvfp4": ("nvfp4-pack-quantized", dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False)),
}


def calibrate(module):
    args = module.quantization_scheme.weights
    w = module.weight.data.float()
    rows, cols = w.shape
    if args.strategy == "channel":
        scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
    elif args.strategy == "tensor":
        scale, _ = calculate_qparams(w.amin(), w.amax(), args)
    elif args.strategy == "block":
        bh, bw = args.block_structure
        blocks = w.reshape(rows // bh, bh, cols // bw, bw).transpose(1, 2)
        scale, _ = calculate_qparams(blocks.amin(dim=(-1, -2)), blocks.amax(dim=(-1, -2)), args)
    else:  # tensor_group: a global scale, then a scale per group of 16
        gs = generate_gparam(w.amin(), w.amax())
        groups = w.reshape(rows, cols // args.group_size, args.group_size)
        scale, _ = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args, global_scale=gs)
        module.weight_global_scale.data.copy_(gs.reshape(module.weight_global_scale.shape))
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))


def quantized_linears(model):
    return [(n, m) for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    source = args.checkpoints / "qwen3-quant"
    for name, (fmt, weights) in SCHEMES.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        config = QuantizationConfig(
            config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))},
            ignore=["lm_head"],
            format=fmt,
        )
        apply_quantization_config(model, config)
        for _, module in quantized_linears(model):
            calibrate(module)
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
        compressor.compress_model(model)
        out = args.out / f"ct-{name}"
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        compressor.update_config(str(out))
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            if (source / extra).exists():
                shutil.copy(source / extra, out / extra)
        # The library's own decompression of what it wrote.
        compressor.decompress_model(model)
        dequantized = {f"{n}.weight": m.weight.data.to(torch.bfloat16).contiguous() for n, m in quantized_linears(model)}
        meta = {"compressed_tensors": __import__("compressed_tensors").__version__, "torch": torch.__version__, "scheme": name}
        save_file(dequantized, str(args.out / f"ct-{name}.dequantized.safetensors"), metadata=meta)
        q = json.loads((out / "config.json").read_text()).get("quantization_config", {})
        print(f"{out}: {len(dequantized)} quantized linears, format {q.get('format')}")


if __name__ == "__main__":
    main()
