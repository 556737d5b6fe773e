#!/usr/bin/env python3
"""Quantized checkpoints written by NVIDIA ModelOpt, and the weights ModelOpt dequantizes them to.

Usage (torch, transformers, safetensors and nvidia-modelopt 0.47.0 installed; no GPU is needed,
everything runs on CPU):
    strata model synth --cases tests/oracle/quant/cases.json --out CKPTS
    python3 tests/oracle/quant/make_modelopt.py --checkpoints CKPTS --out tests/oracle/quant

For every scheme below (ModelOpt's presets `mtq.NVFP4_DEFAULT_CFG` and `mtq.FP8_DEFAULT_CFG`) it
loads CKPTS/qwen3-quant (bf16) with transformers, quantizes it with `mtq.quantize` (max
calibration: one forward pass over a fixed row of token ids), and exports it with ModelOpt's own
Hugging Face exporter `modelopt.torch.export.export_hf_checkpoint` to OUT/modelopt-<scheme>/
(config.json with its `quantization_config` — `quant_method: modelopt` — hf_quant_config.json,
generation_config.json, model.safetensors; the tokenizer files are copied from the source, which
the exporter does not do). lm_head and the embeddings stay bf16 (the presets exclude them).

It then writes OUT/modelopt-<scheme>.dequantized.safetensors: every quantized Linear's weight,
under its plain `...weight` name, as ModelOpt's own dequantizers compute it from the EXPORTED
tensors — `NVFP4QTensor.dequantize` (e2m1 * (weight_scale * weight_scale_2), block 16) and
`FP8QTensor.dequantize` (weight * weight_scale) from `modelopt.torch.quantization.qtensor`, asked
for float32 and then rounded to bf16 (with dtype=bf16 the FP8 path would round the f32 scale to
bf16 before multiplying; strata computes in f32, so the f32 result is the reference). strata's
loader must reproduce it bit for bit (model/tests/quantized.rs). Note for NVFP4: ModelOpt's e2m1
table (`nvfp4_tensor.e2m1_values`) decodes code 0b1000 (negative zero, which its exporter does
write) as +0.0, so this file holds +0 there, not -0 (check_modelopt.py counts them). As a
cross-check the script also prints how many elements differ from the model's own fake-quantized
weight (the weight quantizer applied to the bf16 weight before export) where ModelOpt can compute
it: on CPU only for FP8 (NVFP4 fake quantization needs CUDA or Triton: "amax must be a CUDA tensor for dynamic block
quantization"). That count is informational, not a failure: the fake quantizer works in the
model's bf16 arithmetic (bf16 amax, bf16 scaling), so some of its values land a few bf16 ulps away
from the exported e4m3 codes times their f32 scale; the exported checkpoint is the reference.
"""

import argparse
import json
import pathlib
import shutil

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

import modelopt
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor

SCHEMES = {
    "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    "fp8": mtq.FP8_DEFAULT_CFG,
}

# Calibration input: fixed token ids inside the synthesized vocabulary (320).
CALIBRATION_IDS = torch.tensor([[1, 5, 17, 42, 99, 7, 3, 250, 128, 64, 31, 300, 11, 2, 77, 160]])


def quantized_linears(model):
    out = []
    for name, module in model.named_modules():
        q = getattr(module, "weight_quantizer", None)
        if isinstance(module, torch.nn.Linear) and q is not None and q.is_enabled:
            out.append((name, module))
    return out


def dequantize(tensors, base, weight):
    """ModelOpt's own dequantization of one exported Linear, in f32."""
    scale = tensors[f"{base}.weight_scale"]
    if weight.dtype == torch.uint8:  # NVFP4: two e2m1 per byte
        rows, half = weight.shape
        shape = torch.Size([rows, half * 2])
        q = NVFP4QTensor(shape, torch.float32, weight)
        return q.dequantize(
            dtype=torch.float32, scale=scale, double_scale=tensors[f"{base}.weight_scale_2"], block_sizes={-1: 16}
        )
    assert weight.dtype == torch.float8_e4m3fn, weight.dtype
    q = FP8QTensor(weight.shape, torch.float32, weight)
    return q.dequantize(dtype=torch.float32, scale=scale)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    source = args.checkpoints / "qwen3-quant"
    torch.manual_seed(0)
    for name, cfg in SCHEMES.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        model.eval()

        def forward_loop(m):
            with torch.no_grad():
                m(input_ids=CALIBRATION_IDS)

        model = mtq.quantize(model, cfg, forward_loop)
        linears = quantized_linears(model)
        names = [f"{n}.weight" for n, _ in linears]
        try:  # ModelOpt's NVFP4 fake quantization has CUDA/Triton kernels only; FP8's runs on CPU.
            with torch.no_grad():
                fake = {f"{n}.weight": m.weight_quantizer(m.weight).to(torch.bfloat16).clone() for n, m in linears}
        except (AssertionError, RuntimeError, ImportError) as e:
            fake = None
            print(f"{name}: no fake-quantization cross-check on this machine: {e}")

        out = args.out / f"modelopt-{name}"
        shutil.rmtree(out, ignore_errors=True)
        export_hf_checkpoint(model, export_dir=out)
        for extra in ("tokenizer.json", "tokenizer_config.json"):
            if (source / extra).exists() and not (out / extra).exists():
                shutil.copy(source / extra, out / extra)

        with safe_open(out / "model.safetensors", "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        dequantized = {}
        for key in names:
            base = key[: -len(".weight")]
            dequantized[key] = dequantize(tensors, base, tensors[key]).to(torch.bfloat16).contiguous()
        if fake is not None:
            differing = sum(int((dequantized[k].view(torch.int16) != fake[k].view(torch.int16)).sum()) for k in fake)
            total = sum(t.numel() for t in fake.values())
            check = f"{differing}/{total} elements differ from the fake-quantized weights"
        else:
            check = "fake-quantized weights not available"
        meta = {
            "modelopt": modelopt.__version__,
            "torch": torch.__version__,
            "scheme": name,
            "dequantizer": "modelopt.torch.quantization.qtensor NVFP4QTensor/FP8QTensor.dequantize(dtype=float32), rounded to bf16",
        }
        save_file(dequantized, str(args.out / f"modelopt-{name}.dequantized.safetensors"), metadata=meta)
        q = json.loads((out / "config.json").read_text()).get("quantization_config", {})
        print(
            f"{out}: {len(dequantized)} quantized linears, quant_method {q.get('quant_method')}, "
            f"quant_algo {q.get('quant_algo')}; {check}"
        )


if __name__ == "__main__":
    main()
