#!/usr/bin/env bash
# Regenerates the HF transformers logit fixtures on a machine that has torch and transformers
# (the GPU machine; the math runs on its CPU). Needs the synthesized checkpoints, made beforehand
# with: strata model synth --cases tests/oracle/cases.json --out .device/oracle-ckpts
# Usage: scripts/device/oracle.sh CKPTS OUTDIR
set -euo pipefail
ckpts=${1:?checkpoint directory}
out=${2:?output directory}
root=$(cd "$(dirname "$0")/../.." && pwd)
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
CUDA_VISIBLE_DEVICES="" PYTHONUNBUFFERED=1 python3 "$root/tests/oracle/make_fixtures.py" \
  --cases "$root/tests/oracle/cases.json" --checkpoints "$ckpts" --out "$out"
ls -l "$out"
