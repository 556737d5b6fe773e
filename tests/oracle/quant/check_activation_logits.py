#!/usr/bin/env python3
"""Logits of activation-quantized checkpoints written by `strata quantize` (W8A8 with static and
with per-token FP8 scales, W4A4 NVFP4), as transformers computes them through compressed-tensors'
own forward: each Linear's input quantized and dequantized before its product.

Usage (torch, transformers and compressed-tensors installed; no GPU is needed):
    strata model synth --cases tests/oracle/quant/cases.json --out CKPTS
    T="--calibrate tests/oracle/quant/calibration.txt --calibration-context 128 --calibration-sequences 4"
    strata quantize --plan fp8 --model CKPTS/qwen3-quant --out QUANT/fp8-static $T
    strata quantize --plan fp8-dynamic --model CKPTS/qwen3-quant --out QUANT/fp8-dynamic
    strata quantize --plan nvfp4 --model CKPTS/qwen3-quant --out QUANT/nvfp4-w4a4 $T
    python3 tests/oracle/quant/check_activation_logits.py --quantized QUANT \\
        --out tests/oracle/quant/activation-logits.json

Each model runs in f32 (weights as below) on four sequences (the calibration tokens' first four runs of 12) and the
last position's logits are kept. model/tests/quantized.rs runs the same files through strata's CPU
reference with `quantize_activations` and compares.
"""

import argparse
import json
import pathlib

import torch
import transformers
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors.torch import load_file
from transformers import CompressedTensorsConfig

PLANS = ["fp8-static", "fp8-dynamic", "nvfp4-w4a4"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    calibration = json.loads((pathlib.Path(__file__).parent / "calibration.json").read_text())
    sequences = [s[:12] for s in calibration["sequences"][:4]]
    result = {"about": __doc__.splitlines()[0], "sequences": sequences, "plans": {}}
    for plan in PLANS:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.quantized / plan, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False))
        model.eval()
        # The products run in f32. compressed-tensors' NVFP4 decompression rounds the weights to
        # bf16 (its unpacking's default dtype), which strata does not (it multiplies the f32 the
        # library's own formula gives): NVFP4 weights are dequantized again by the library's
        # functions in f32, so both sides multiply the same weights and differ only in how they
        # treat the activations.
        stored = load_file(str(args.quantized / plan / "model.safetensors"))
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if f"{name}.weight_packed" in stored:
                packed = stored[f"{name}.weight_packed"]
                m, n = packed.shape
                module.weight.data = dequantize(
                    x_q=unpack_fp4_from_uint8(packed, m, n * 2, dtype=torch.float32),
                    scale=stored[f"{name}.weight_scale"].to(torch.float32),
                    args=module.quantization_scheme.weights,
                    global_scale=stored[f"{name}.weight_global_scale"],
                    dtype=torch.float32,
                )
            else:
                module.weight.data = module.weight.data.float()
        quantized_inputs = sum(
            1 for m in model.modules()
            if getattr(getattr(m, "quantization_scheme", None), "input_activations", None))
        with torch.no_grad():
            logits = [model(torch.tensor([s])).logits[0, -1].tolist() for s in sequences]
        result["plans"][plan] = {"quantized_inputs": quantized_inputs, "logits": logits}
        print(f"{plan}: {quantized_inputs} Linears quantize their inputs")
    import compressed_tensors
    result["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__,
                          "compressed_tensors": compressed_tensors.__version__}
    args.out.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
