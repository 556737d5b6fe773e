#!/usr/bin/env bash
# Quality of activation-quantized arithmetic (W8A8, W4A4) on a real model, on the CPU reference,
# beside the same files' weight-only arithmetic:
#   scripts/activation_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]
# Calibration (static scales) reads the last 64 KB of TEXT; evaluation scores its first CHUNKS
# chunks of CONTEXT tokens, so the two do not overlap. Arms: fp8 calibrated (W8A16 weight-only,
# W8A8 static), fp8-dynamic (W8A8 per token), nvfp4 calibrated (W4A16, W4A4). Each is compared
# with MODEL by `strata eval compare` (both perplexities, KL(baseline ‖ arm), top-1 agreement,
# greedy agreement over 64 tokens).
# Writes OUT_DIR/receipt.json.
set -euo pipefail
model=${1:?usage: activation_quality.sh MODEL TEXT OUT_DIR [CONTEXT] [CHUNKS]}
text=${2:?text}
out=${3:?out dir}
context=${4:-512}
chunks=${5:-8}
bin=${STRATA:-target/release/strata}
mkdir -p "$out"
tail -c 65536 "$text" >"$out/calibration.txt"
quantize() { # PLAN DIR [ARGS...]
    local plan=$1 dir=$2
    shift 2
    rm -rf "$out/$dir"
    "$bin" quantize --plan "$plan" --model "$model" --out "$out/$dir" "$@" >"$out/$dir.quantize.txt"
    tail -1 "$out/$dir.quantize.txt"
}
quantize fp8 fp8-calibrated --calibrate "$out/calibration.txt"
quantize fp8-dynamic fp8-dynamic
quantize nvfp4 nvfp4-calibrated --calibrate "$out/calibration.txt"
compare() { # ARM DIR [ARGS...]
    local arm=$1 dir=$2
    shift 2
    "$bin" eval compare --model "$model" --candidate "$out/$dir" --text "$text" \
        --context "$context" --max-chunks "$chunks" --greedy 64 --json "$out/$arm.json" "$@" 2>/dev/null |
        tee "$out/$arm.txt"
}
compare w8a16 fp8-calibrated
compare w8a8-static fp8-calibrated --quantize-activations
compare w8a8-token fp8-dynamic --quantize-activations
compare w4a16 nvfp4-calibrated
compare w4a4 nvfp4-calibrated --quantize-activations
python3 "$(dirname "$0")/eval_receipt.py" --out "$out" --model "$model" --binary "$bin" \
    --what "activation-quantized (W8A8, W4A4) against weight-only arithmetic of strata quantize files, scored by strata eval compare on the CPU reference (--quantize-activations)" \
    --note "calibration=the text's last 64 KB (strata quantize --calibrate, 16 sequences of 512 tokens)" \
    w8a16 w8a8-static w8a8-token w4a16 w4a4
