#!/usr/bin/env bash
# The KV tiers on the GPU machine (issue 21's battery), with the carried release binary:
#   scripts/device/kv_tiers.sh OUT_DIR
# It builds nothing. An 8B-shaped Llama (bf16, synthesized weights, the Llama 3.1 tokenizer
# carried in .device/llama3_1, a 40k window) is served by `strata serve --device cuda:0` twice:
#   1. host tier: an 8 GiB device cache (two 32k contexts) and a 16 GiB page-locked host tier. A
#      32k-token context is computed cold (its TTFT: the recompute cost), continued greedily,
#      pushed to host by three other 32k contexts, then asked again (its TTFT: the restore) and
#      continued greedily after a second push (byte-identical to the never-evicted continuation);
#      the restore bandwidth comes from /metrics (bytes restored / restore time), as a fraction
#      of the 55.3 GB/s the machine's pinned PCIe copies reach (H200.md);
#   2. disk tier: no host tier, a disk tier under $TMPDIR; the same context pushed to disk and
#      restored (the disk read rate: bytes / restore time, read and copy together), then the
#      server SIGKILLed and restarted on the same directory, and the context restored again;
#   3. long: a 20 GiB device cache and a 40 GiB host tier; a LONG-token context (131072 by
#      default) primed, continued, pushed to host by five 32k prompts, restored and continued
#      again (byte-identical to the never-evicted continuation).
# The pinned host-to-device rate the restores are compared with is measured first (PyTorch,
# 1 GiB page-locked copies). PHASES (default host,disk,long) picks the servers run. KV_RESTORE
# (auto, the engine's default, or always) is passed to every server as --kv-restore: the disk
# phase run with `always` against `auto` is the restore chooser's canary (forced to restore a
# tier slower than recomputing, the first token must come later).
# Everything lands in OUT_DIR with receipt.json; exits non-zero if a check failed.
set -uo pipefail

OUT=${1:?usage: kv_tiers.sh OUT_DIR}
BIN=${STRATA_BIN:-.device/strata}
BENCH_CONFIG=${BENCH_CONFIG:-configs/llama-3.1-8b.json}
TOKENIZER=${TOKENIZER:-.device/llama3_1/tokenizer.json}
CONTEXT=${CONTEXT:-32000}
LONG=${LONG:-131072}
PHASES=${PHASES:-host,disk,long}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
MODEL=${TMPDIR:-/tmp}/strata-kv-8b
DISK=${TMPDIR:-/tmp}/strata-kv-disk
PORT=18281
MAX_POSITION=$((LONG + 1024))
mkdir -p "$OUT/logs"

# shellcheck source=scripts/device/common.sh
. "$(dirname "$0")/common.sh"
record_machine
start=$SECONDS
synth_bench_model
echo "synthesized $(du -sh "$MODEL" | cut -f1) in $((SECONDS - start)) s"

serve() { # name serve-args...
    local name=$1
    shift
    "$BIN" serve --model "$MODEL" --device cuda:0 --port $PORT --kv-restore "${KV_RESTORE:-auto}" "$@" \
        >>"$OUT/logs/serve-$name.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && return 0
        kill -0 $SERVER 2>/dev/null || break
        sleep 0.5
    done
    echo "serve ($name) did not come up"
    tail -20 "$OUT/logs/serve-$name.log"
    return 1
}

PINNED_GBS=$(python3 - <<'PY'
import torch
host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
device = torch.empty_like(host, device="cuda")
for _ in range(3):
    device.copy_(host, non_blocking=True)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    device.copy_(host, non_blocking=True)
end.record()
end.synchronize()
print(round(10 * (1 << 30) / (start.elapsed_time(end) / 1e3) / 1e9, 2))
PY
)
echo "pinned host-to-device: $PINNED_GBS GB/s"
echo "$PINNED_GBS" >"$OUT/pinned_gbs.txt"
# Both directions at once, as a restore into a full device cache moves them (one block out to
# the host tier for each block in): 1 GiB each way on two streams, 10 times.
python3 - "$OUT" <<'PY'
import json, pathlib, sys, torch
up_host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
down_host = torch.empty_like(up_host).pin_memory()
up_dev, down_dev = torch.empty_like(up_host, device="cuda"), torch.empty_like(up_host, device="cuda")
up, down = torch.cuda.Stream(), torch.cuda.Stream()
def both(n):
    for _ in range(n):
        with torch.cuda.stream(up):
            up_dev.copy_(up_host, non_blocking=True)
        with torch.cuda.stream(down):
            down_host.copy_(down_dev, non_blocking=True)
both(2)
torch.cuda.synchronize()
start = torch.cuda.Event(enable_timing=True)
start.record()
ends = []
for stream in (up, down):
    stream.wait_event(start)
both(10)
for stream in (up, down):
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    ends.append(e)
torch.cuda.synchronize()
h2d, d2h = (round(10 * (1 << 30) / (start.elapsed_time(e) / 1e3) / 1e9, 2) for e in ends)
rates = {"h2d_gbs": h2d, "d2h_gbs": d2h}
print("pinned both directions at once:", rates)
(pathlib.Path(sys.argv[1]) / "pinned_bidirectional.json").write_text(json.dumps(rates))
PY

drive() { # phase args...
    local phase=$1
    shift
    python3 "$(dirname "$0")/kv_tiers.py" --url "http://127.0.0.1:$PORT" --phase "$phase" \
        --pinned-gbs "$PINNED_GBS" --out "$OUT/$phase.json" "$@" 2>&1 | tee "$OUT/logs/$phase.log"
    return "${PIPESTATUS[0]}"
}
wanted() { [[ ",$PHASES," == *",$1,"* ]]; }

failed=0
if wanted host; then
    serve host --kv-cache-mib 8192 --kv-host-mib 16384 || exit 1
    drive host --context "$CONTEXT" || failed=1
    kill $SERVER
    wait $SERVER 2>/dev/null
fi

if wanted disk; then
    rm -rf "$DISK"
    serve disk --kv-cache-mib 8192 --kv-disk-dir "$DISK" --kv-disk-mib 32768 || exit 1
    drive disk --context "$CONTEXT" || failed=1
    kill -9 $SERVER
    wait $SERVER 2>/dev/null
    # The restarted server reads its blocks from the disk, not the page cache, where allowed.
    sync
    if echo 3 >/proc/sys/vm/drop_caches 2>/dev/null; then echo true; else echo false; fi >"$OUT/caches_dropped.txt"
    cat "$MODEL"/*.safetensors >/dev/null
    serve disk-restarted --kv-cache-mib 8192 --kv-disk-dir "$DISK" --kv-disk-mib 32768 || exit 1
    drive disk-restarted --context "$CONTEXT" || failed=1
    kill $SERVER
    wait $SERVER 2>/dev/null
fi

if wanted disk; then
    # The disk's own rates beside the tier's: one 4 GiB file read sequentially (16 MiB reads),
    # and the tier's file layout (2 MiB files) read by 8 threads, page cache dropped first where
    # allowed.
    python3 - "$OUT" "$DISK" <<'PY' || failed=1
import json, os, pathlib, sys, time
from concurrent.futures import ThreadPoolExecutor
out, disk = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def drop():
    os.sync()
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False
big = disk.parent / "strata-disk-rate.bin"
with open(big, "wb") as f:
    block = os.urandom(16 << 20)
    for _ in range(256):
        f.write(block)
dropped = drop()
start = time.perf_counter()
with open(big, "rb", buffering=0) as f:
    while f.read(16 << 20):
        pass
sequential = (256 << 24) / (time.perf_counter() - start) / 1e9
big.unlink()
files = [p for p in disk.rglob("*") if p.is_file() and len(p.name) == 32]
drop()
start = time.perf_counter()
with ThreadPoolExecutor(8) as pool:
    total = sum(pool.map(lambda p: len(p.read_bytes()), files))
parallel = total / (time.perf_counter() - start) / 1e9 if files else 0
rates = {"caches_dropped": dropped, "sequential_16mib_gbs": round(sequential, 2),
         "block_files": len(files), "block_files_8_threads_gbs": round(parallel, 2)}
print("disk rates:", rates)
(out / "disk-rates.json").write_text(json.dumps(rates, indent=2))
PY
fi

if wanted long; then
    serve long --kv-cache-mib 20480 --kv-host-mib 40960 || exit 1
    drive long --context "$LONG" --push 5 --push-context 32768 || failed=1
    kill $SERVER
    wait $SERVER 2>/dev/null
fi

python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
phases = {p: json.loads((out / f"{p}.json").read_text())
          for p in ("host", "disk", "disk-restarted", "long") if (out / f"{p}.json").exists()}
receipt = {"machine": (out / "machine.txt").read_text().splitlines(),
           "pinned_h2d_gbs": float((out / "pinned_gbs.txt").read_text()), "phases": phases}
for extra in ("pinned_bidirectional", "disk-rates", "caches_dropped"):
    for path in (out / f"{extra}.json", out / f"{extra}.txt"):
        if path.exists():
            receipt[extra] = json.loads(path.read_text())
(out / "receipt.json").write_text(json.dumps(receipt, indent=2))
for name, p in phases.items():
    print(f"{name:16} " + "  ".join(f"{k}={v}" for k, v in p.items() if not isinstance(v, (list, dict))))
EOF
exit $failed
