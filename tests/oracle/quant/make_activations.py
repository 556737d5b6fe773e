#!/usr/bin/env python3
"""Activations quantized and dequantized by compressed-tensors' own forward (`forward_quantize`),
for each input scheme strata reads: FP8 with a static per-tensor scale, FP8 with a dynamic scale
per token, NVFP4 (e2m1 in groups of 16, local e4m3 scales under a static global scale).

Usage (torch and compressed-tensors installed; no GPU is needed):
    python3 tests/oracle/quant/make_activations.py --out tests/oracle/quant/activations.json

Rows of 64 values in f32: random normal rows at three magnitudes, a row of zeros, a row with one
group of zeros, values past e4m3's range once scaled, exact ties of both grids. model/src/quantize
(`activations`) must reproduce every output bit for bit.
"""

import argparse
import json
import pathlib

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import forward_quantize

WIDTH = 64


def rows():
    g = torch.Generator().manual_seed(22)
    out = [torch.randn(WIDTH, generator=g) * s for s in (0.01, 1.0, 300.0)]
    out.append(torch.zeros(WIDTH))
    one_zero_group = torch.randn(WIDTH, generator=g)
    one_zero_group[16:32] = 0.0
    out.append(one_zero_group)
    # Exact ties once divided by a scale of 1: e4m3 between 1 and 1.125, e2m1 between 2 and 3.
    ties = torch.full((WIDTH,), 1.0625)
    ties[::2] = 2.5
    ties[1::4] = -5.0
    out.append(ties)
    return torch.stack(out).to(torch.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    x = rows()
    schemes = {
        "fp8_static": (QuantizationArgs(num_bits=8, type="float", strategy="tensor",
                                        symmetric=True, dynamic=False),
                       {"input_scale": torch.tensor([0.37], dtype=torch.float32)}),
        "fp8_static_unit": (QuantizationArgs(num_bits=8, type="float", strategy="tensor",
                                             symmetric=True, dynamic=False),
                            {"input_scale": torch.tensor([1.0], dtype=torch.float32)}),
        "fp8_token": (QuantizationArgs(num_bits=8, type="float", strategy="token",
                                       symmetric=True, dynamic=True), {}),
        "nvfp4": (QuantizationArgs(num_bits=4, type="float", strategy="tensor_group",
                                   group_size=16, symmetric=True, dynamic="local",
                                   scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn),
                  {"input_global_scale": torch.tensor([96.5], dtype=torch.float32)}),
    }
    cases = {}
    for name, (qargs, params) in schemes.items():
        module = torch.nn.Module()
        module.quantization_status = QuantizationStatus.FROZEN
        for key, value in params.items():
            setattr(module, key, value)
        # [batch, tokens, hidden], as a Linear sees its input in transformers' forward (a
        # per-token scale reduces over the last dimension only).
        out = forward_quantize(module, x.clone().unsqueeze(0), "input", qargs).squeeze(0)
        cases[name] = {
            "params": {k: v.item() for k, v in params.items()},
            "output": [[float(v) for v in row] for row in out],
        }
    import compressed_tensors
    result = {
        "about": __doc__.splitlines()[0],
        "versions": {"torch": torch.__version__,
                     "compressed_tensors": compressed_tensors.__version__},
        "width": WIDTH,
        "input": [[float(v) for v in row] for row in x],
        "cases": cases,
    }
    args.out.write_text(json.dumps(result) + "\n")
    print(f"{args.out}: {len(cases)} schemes over {len(x)} rows of {WIDTH}")


if __name__ == "__main__":
    main()
