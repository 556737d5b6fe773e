#!/usr/bin/env bash
# Quality of every `strata quantize` plan on a real model, on the CPU reference:
#   scripts/quant_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]
# MODEL (an HF directory or a GGUF file) is the baseline as the reference reads it (a GGUF's
# blocks widened exactly); each plan quantizes it (strata quantize) and is compared with it on
# TEXT by `strata eval compare` (llama.cpp's perplexity positions): both perplexities, the mean
# and largest KL(baseline ‖ plan), the top-1 agreement and the greedy agreement (64 tokens
# continued by each from the first halves of the scored chunks). nvfp4-kept scores the nvfp4
# file in the arithmetic the GPU computes with --keep-quantized (the tiles'). Writes OUT_DIR/receipt.json: per plan
# those, the perplexity ratio, the mean and worst relative RMS error of its Linear projections,
# and the weights' bytes.
set -euo pipefail
model=${1:?usage: quant_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]}
text=${2:?text}
out=${3:?out dir}
context=${4:-512}
chunks=${5:-8}
bin=${STRATA:-target/release/strata}
mkdir -p "$out"
for plan in fp8 fp8-block nvfp4 nvfp4-4o6 mixed; do
    rm -rf "$out/$plan"
    "$bin" quantize --plan "$plan" --model "$model" --out "$out/$plan" >"$out/$plan.quantize.txt"
    tail -1 "$out/$plan.quantize.txt"
    "$bin" eval compare --model "$model" --candidate "$out/$plan" --text "$text" \
        --context "$context" --max-chunks "$chunks" --greedy 64 --json "$out/$plan.json" 2>/dev/null |
        tee "$out/$plan.txt"
done
# NVFP4 kept: the arithmetic the GPU's tiles compute (--keep-quantized), on the same file.
"$bin" eval compare --model "$model" --candidate "$out/nvfp4" --text "$text" --keep-quantized \
    --context "$context" --max-chunks "$chunks" --greedy 64 --json "$out/nvfp4-kept.json" 2>/dev/null |
    tee "$out/nvfp4-kept.txt"
python3 "$(dirname "$0")/eval_receipt.py" --out "$out" --model "$model" --binary "$bin" \
    --what "strata quantize plans scored by strata eval perplexity on the CPU reference" \
    --group plans fp8 fp8-block nvfp4 nvfp4-kept nvfp4-4o6 mixed
