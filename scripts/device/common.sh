# Shared by the device scripts (source it after setting BIN and OUT).

# The machine and binary a run used, into $OUT/machine.txt and on the terminal.
record_machine() {
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        "$BIN" --version
        sha256sum "$BIN"
    } >"$OUT/machine.txt" 2>&1
    cat "$OUT/machine.txt"
}

# A value of $BENCH_CONFIG (a config.json).
shape() { python3 -c "import json,sys; c=json.load(open('$BENCH_CONFIG')); print(c[sys.argv[1]])" "$1"; }

# $BENCH_CONFIG's shape (cut to $LAYERS layers when set) synthesized into $MODEL (bf16, random
# weights, $TOKENIZER's vocabulary sizing the embedding and LM head, a window of $MAX_POSITION
# tokens, 8192 by default), then read once so it sits in the page cache as a served model usually
# does. Exits on failure.
synth_bench_model() {
    "$BIN" model synth --arch llama --out "$MODEL" --layers "${LAYERS:-$(shape num_hidden_layers)}" \
        --hidden "$(shape hidden_size)" --heads "$(shape num_attention_heads)" \
        --kv-heads "$(shape num_key_value_heads)" --intermediate "$(shape intermediate_size)" \
        --max-position "${MAX_POSITION:-8192}" --rope-theta 500000 --tokenizer "$TOKENIZER" \
        >"$OUT/logs/synth.log" 2>&1 ||
        { echo "synth FAILED"; cat "$OUT/logs/synth.log"; exit 1; }
    cat "$MODEL"/*.safetensors >/dev/null
}

# Waits up to 5 minutes for the server on port $1 (process $2) to answer /health; fails at once
# if the process ends first.
wait_healthy() {
    local port=$1 pid=$2
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || return 1
        sleep 0.5
    done
    return 1
}
