#!/usr/bin/env python3
"""Activation ranges of the synthesized quantization model measured by transformers, the scales
compressed-tensors derives from them, and the scales transformers loads from files written by
`strata quantize --calibrate`.

Usage (torch, transformers and compressed-tensors installed; no GPU is needed):
    strata model synth --cases tests/oracle/quant/cases.json --out CKPTS
    for p in fp8 nvfp4; do
        strata quantize --plan $p --model CKPTS/qwen3-quant --out QUANT/$p \\
            --calibrate tests/oracle/quant/calibration.txt --calibration-context 128 --calibration-sequences 4
    done
    python3 tests/oracle/quant/check_calibration.py --model CKPTS/qwen3-quant --quantized QUANT \\
        --out tests/oracle/quant/calibration.json

The text is tokenized by transformers and cut as strata cuts it (sequences of 128 tokens, at most
4, a last one of fewer than two tokens dropped); each sequence runs alone from position 0 in f32,
and a forward pre-hook on every Linear but the LM head keeps its input's largest magnitude.
compressed-tensors' `calculate_qparams` (FP8, per tensor, symmetric) and `generate_gparam` (the
NVFP4 global scale) turn each into a scale. The quantized files are loaded in f32, so their scales
are read unrounded. model/tests/quantized.rs measures the same model in
strata and compares: its token ids equal, its ranges close (f32 sums in another order), the scale
formulas bit for bit, and the scales transformers loaded from strata's files equal to what strata
writes.
"""

import argparse
import json
import pathlib

import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from transformers import CompressedTensorsConfig

CONTEXT = 128
SEQUENCES = 4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=pathlib.Path)
    parser.add_argument("--quantized", required=True, type=pathlib.Path)
    parser.add_argument("--text", type=pathlib.Path,
                        default=pathlib.Path(__file__).parent / "calibration.txt")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(args.text.read_text(encoding="utf-8"))["input_ids"]
    sequences = [ids[i:i + CONTEXT] for i in range(0, len(ids), CONTEXT)]
    sequences = [s for s in sequences if len(s) >= 2][:SEQUENCES]

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    amax = {}

    def hook(name):
        def observe(_module, inputs):
            seen = inputs[0].detach().abs().max().item()
            amax[name] = max(amax.get(name, 0.0), seen)
        return observe

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for s in sequences:
            model(torch.tensor([s]))

    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    linears = {}
    for name, value in sorted(amax.items()):
        a = torch.tensor([value], dtype=torch.float32)
        scale, _ = calculate_qparams(-a, a, fp8)
        linears[name] = {
            "amax": value,
            "fp8_input_scale": scale.item(),
            "nvfp4_input_global_scale": generate_gparam(-a, a).item(),
        }

    loaded = {}
    for plan, key in [("fp8", "input_scale"), ("nvfp4", "input_global_scale")]:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            args.quantized / plan, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False))
        loaded[plan] = {
            name: getattr(module, key).item()
            for name, module in quantized.named_modules()
            if hasattr(module, key) and isinstance(getattr(module, key), torch.Tensor)
        }
        assert len(loaded[plan]) == len(linears), (plan, sorted(loaded[plan]))

    import compressed_tensors
    result = {
        "about": __doc__.splitlines()[0],
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "compressed_tensors": compressed_tensors.__version__},
        "context": CONTEXT,
        "sequences": sequences,
        "linears": linears,
        "loaded": loaded,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.out}: {len(linears)} Linear inputs over {sum(map(len, sequences))} tokens")


if __name__ == "__main__":
    main()
