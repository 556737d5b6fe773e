#!/usr/bin/env bash
# FP8 and NVFP4 checkpoints through the CUDA engine, kept in strata's device blocks
# (`--keep-quantized`) or widened to bf16 (issue 22's battery), with the carried release binary
# and the Llama 3.1 tokenizer in .device/llama3_1:
#   scripts/device/quant_engine.sh OUT_DIR
# It builds nothing. In order (PARTS picks: selftest, identity, decode, prefill, tiles):
#   1. `strata kernels selftest`: every block format's dequantizer, GEMV, shard GEMV and gather
#      bit for bit against the bf16 kernels on the CPU loader's values (NVFP4 in both
#      conventions, FP8), with canaries;
#   2. identity: a small Llama (4 layers, hidden 1024) synthesized, quantized by
#      `strata quantize` (fp8, nvfp4, mixed); each generates greedily on the GPU with its
#      weights kept in blocks (`--quant-blocks`) and widened — the texts must be equal (the
#      blocks compute the widened model's bits) — and passes `strata gpu parity
#      --keep-quantized` (NVFP4 in tiles, their own arithmetic) against the CPU reference, and
#      for FP8 plans `--keep-quantized --fp8-tiles` too (FP8 in tiles);
#   3. decode: the Llama-3.1-8B shape synthesized (bf16), quantized to fp8 and nvfp4 (timed),
#      `strata gpu decode` at BATCHES for bf16, each format kept (NVFP4 in tiles, FP8 in blocks)
#      and FP8 in tiles (`--fp8-tiles`), and with WIDENED=1 each widened and each in blocks
#      (`--quant-blocks`), with its graph == eager checks: tokens/s against bf16 and against
#      each format's byte roofline;
#   4. prefill: `strata kernels bench --m 1`'s prompt-row GEMMs of a 4k prefill (m = 4096, the 8B
#      projections), bf16 against FP8 (e4m3) in TFLOP/s — the W8A8 product, its scales aside;
#   5. tiles: `strata kernels bench --tiles` at 1-64 rows, the GEMV per weight layout on the four
#      8B projections and per M the tiles in the engine's shapes against bf16 (tiles.json);
#   6. profile: the 8B shape cut to PROFILE_LAYERS layers (4), bf16 and NVFP4 kept in tiles,
#      `strata gpu decode --profile` at BATCHES: each step's kernel time by family (what the
#      GEMVs leave to the norms, rope, attention and the LM head), profile-*.txt.
# Everything lands in OUT_DIR with receipt.json; a short table is printed last.
set -uo pipefail

OUT=${1:?usage: quant_engine.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
TOKENIZER=${TOKENIZER:-.device/llama3_1/tokenizer.json}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
FILES=${FILES:-${TMPDIR:-/tmp}/strata-quant-engine}
BATCHES=${BATCHES:-1,8,32,64}
PARTS=${PARTS:-selftest,identity,decode,prefill,tiles,profile}
# The formats the decode part quantizes and measures; WIDENED=0 skips the comparison arms (each
# format widened to bf16, NVFP4 in blocks).
PLANS=${PLANS:-fp8 nvfp4}
WIDENED=${WIDENED:-1}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$OUT/logs" "$FILES"
failed=0
part() { [[ ,$PARTS, == *,$1,* ]]; }
# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine

if part selftest; then
    "$BIN" kernels selftest >"$OUT/selftest.txt" 2>&1 || failed=1
    tail -1 "$OUT/selftest.txt"
fi

if part identity; then
    SMALL=$FILES/small
    "$BIN" model synth --arch llama --out "$SMALL" --layers 4 --hidden 1024 --heads 16 \
        --kv-heads 4 --intermediate 2816 --max-position 2048 --tokenizer "$TOKENIZER" \
        >"$OUT/logs/synth-small.log" 2>&1 || { echo "synth FAILED"; failed=1; }
    for plan in fp8 nvfp4 mixed; do
        "$BIN" quantize --plan $plan --model "$SMALL" --out "$FILES/small-$plan" \
            >"$OUT/logs/quantize-small-$plan.log" 2>&1 || { echo "quantize $plan FAILED"; failed=1; }
        same=1
        for prompt in "The capital of France is" "def fibonacci(n):" "Once upon a time"; do
            for arm in kept widened; do
                flag=()
                [[ $arm == kept ]] && flag=(--keep-quantized --quant-blocks)
                "$BIN" generate --model "$FILES/small-$plan" --device cuda:0 --prompt "$prompt" \
                    --max-tokens 48 --temperature 0 "${flag[@]}" >"$FILES/gen-$arm.txt" \
                    2>>"$OUT/logs/generate-$plan.log" || failed=1
            done
            cmp -s "$FILES/gen-kept.txt" "$FILES/gen-widened.txt" || same=0
        done
        echo "$plan: kept == widened over 3 prompts x 48 tokens: $same" | tee -a "$OUT/identity.txt"
        [[ $same == 1 ]] || failed=1
        "$BIN" gpu parity --model "$FILES/small-$plan" --keep-quantized --prompts 8 --tokens 32 \
            --json "$OUT/parity-$plan.json" 2>&1 | tail -1 | tee -a "$OUT/identity.txt"
        [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
        if [[ $plan != nvfp4 ]]; then
            "$BIN" gpu parity --model "$FILES/small-$plan" --keep-quantized --fp8-tiles \
                --prompts 8 --tokens 32 --json "$OUT/parity-$plan-tiles.json" 2>&1 | tail -1 |
                sed "s/^/fp8 tiles: /" | tee -a "$OUT/identity.txt"
            [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
        fi
    done
fi

if part decode; then
    MODEL=$FILES/bf16-8b
    [[ -f $MODEL/config.json ]] || synth_bench_model
    for plan in $PLANS; do
        # Quantized once per machine: FILES persists between parts and calls.
        if [[ ! -f $FILES/8b-$plan/config.json ]]; then
            start=$SECONDS
            "$BIN" quantize --plan $plan --model "$MODEL" --out "$FILES/8b-$plan" \
                >"$OUT/logs/quantize-8b-$plan.log" 2>&1 || { echo "quantize $plan FAILED"; failed=1; }
            echo "quantize 8B $plan: $((SECONDS - start)) s" | tee -a "$OUT/quantize.txt"
        fi
    done
    decode() { # NAME MODEL FLAGS...
        local name=$1 model=$2
        shift 2
        "$BIN" gpu decode --model "$model" --batch "$BATCHES" --context 512 --steps 64 "$@" \
            --json "$OUT/decode-$name.json" >"$OUT/logs/decode-$name.log" 2>&1 || {
            echo "decode $name FAILED"
            tail -5 "$OUT/logs/decode-$name.log"
            failed=1
        }
    }
    decode bf16 "$MODEL"
    for plan in $PLANS; do
        decode "$plan-kept" "$FILES/8b-$plan" --keep-quantized
        [[ $plan == fp8 ]] && decode fp8-tiles "$FILES/8b-fp8" --keep-quantized --fp8-tiles
        if [[ $WIDENED == 1 ]]; then
            decode "$plan-widened" "$FILES/8b-$plan"
            decode "$plan-blocks" "$FILES/8b-$plan" --keep-quantized --quant-blocks
        fi
    done
fi

if part prefill; then
    "$BIN" kernels bench --m 1 >"$OUT/logs/kernels-bench.log" 2>&1 || failed=1
    grep "^gemm " "$OUT/logs/kernels-bench.log" | tee "$OUT/prefill.txt"
fi

if part tiles; then
    "$BIN" kernels bench --tiles --m 1,8,16,32,64 --json "$OUT/tiles.json" \
        >"$OUT/logs/kernels-bench-tiles.log" 2>&1 || failed=1
    tail -6 "$OUT/logs/kernels-bench-tiles.log" | tee "$OUT/tiles.txt"
fi

if part profile; then
    CUT=$FILES/cut-bf16
    [[ -f $CUT/config.json ]] || MODEL=$CUT LAYERS=${PROFILE_LAYERS:-4} synth_bench_model
    [[ -f $FILES/cut-nvfp4/config.json ]] ||
        "$BIN" quantize --plan nvfp4 --model "$CUT" --out "$FILES/cut-nvfp4" \
            >"$OUT/logs/quantize-cut.log" 2>&1 || { echo "quantize cut FAILED"; failed=1; }
    for arm in bf16 nvfp4; do
        flag=()
        [[ $arm == nvfp4 ]] && flag=(--keep-quantized)
        "$BIN" gpu decode --model "$FILES/cut-$arm" "${flag[@]}" --batch "$BATCHES" --steps 32 \
            --profile >"$OUT/profile-$arm.txt" 2>"$OUT/logs/profile-$arm.log" || {
            echo "profile $arm FAILED"
            failed=1
        }
    done
    grep -E "batch|lm head" "$OUT/profile-nvfp4.txt"
fi

python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
receipt = {"machine": (out / "machine.txt").read_text().splitlines()}
for name in ["selftest.txt", "identity.txt", "quantize.txt", "prefill.txt", "tiles.txt"]:
    p = out / name
    if p.exists():
        receipt[name.split(".")[0]] = p.read_text().splitlines()[-12:]
decode = {}
for p in sorted(out.glob("decode-*.json")):
    decode[p.stem[len("decode-"):]] = json.loads(p.read_text())
receipt["decode"] = decode
profile = {p.stem[len("profile-"):]: p.read_text().splitlines() for p in sorted(out.glob("profile-*.txt"))}
if profile:
    receipt["profile"] = profile
if (out / "tiles.json").exists():
    receipt["tiles_per_m"] = json.loads((out / "tiles.json").read_text())["per_m"]
(out / "receipt.json").write_text(json.dumps(receipt, indent=1) + "\n")
for name, d in decode.items():
    rows = d.get("results") or d.get("batches") or []
    cells = []
    for r in rows:
        if isinstance(r, dict):
            cells.append(f"b{r.get('batch')}: {r.get('tokens_per_s', r.get('tok_s', '?'))}")
    print(f"{name:<16} " + "  ".join(str(c) for c in cells))
EOF
exit $failed
