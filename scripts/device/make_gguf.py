#!/usr/bin/env python3
"""Write a GGUF file (architecture "llama") with random weights in the shape of a HF config.json.

Used by scripts/device/llamacpp-peer.sh so llama.cpp can be benchmarked on the same shapes as strata
without any real weights. Needs numpy only; the GGUF v3 layout is written directly.

    make_gguf.py CONFIG.json OUT.gguf [--dtype bf16|f16|q8_0|q4_k_m] [--layers N] [--seed S]

Weights are N(0, 0.02) (norm weights 1.0, F32), streamed tensor by tensor from one shared random
pool (each tensor starts at a different pool offset), so memory stays under ~400 MB for any size.
The block types are random blocks: random quant bytes from the pool, every f16 scale fixed so a
weight is of the same size as above. q8_0 stores every matrix as Q8_0; q4_k_m follows llama.cpp's
Q4_K_M mix (Q4_K, with Q6_K for the output and for attn_v / ffn_down of the first and last eighth
of the layers and every third layer between).
The tokenizer is synthetic: an SPM-style "llama" vocab of exactly vocab_size tokens
(<unk>, <s>, </s>, the 256 byte tokens, then filler pieces).
"""

import argparse
import json
import math
import struct
import sys
import time

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGN = 32

# GGUF metadata value types
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types and the matching general.file_type
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
GGML_Q8_0, GGML_Q4_K, GGML_Q6_K = 8, 12, 14
FILE_TYPE = {"f16": 1, "bf16": 32, "q8_0": 7, "q4_k_m": 15}
TENSOR_TYPE = {"f16": GGML_F16, "bf16": GGML_BF16, "q8_0": GGML_Q8_0, "q4_k_m": GGML_Q4_K}
# ggml type -> (elements per block, bytes per block, byte offsets of f16 scales and their values)
BLOCKS = {
    GGML_Q8_0: (32, 34, [(0, 0.02 * 2 / 127)]),
    GGML_Q4_K: (256, 144, [(0, 0.02 / 64), (2, 0.02 / 64)]),
    GGML_Q6_K: (256, 210, [(208, 0.02 / 256)]),
}

# token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_BYTE = 1, 2, 3, 6

POOL_ELEMS = 1 << 24  # 16 Mi random values (32 MB as 16-bit), reused for every tensor


def gguf_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


class Meta:
    """Collects key/value metadata in GGUF encoding."""

    def __init__(self):
        self.parts = []
        self.count = 0

    def _add(self, key, vtype, payload):
        self.parts.append(gguf_str(key) + struct.pack("<I", vtype) + payload)
        self.count += 1

    def u32(self, key, v):
        self._add(key, T_UINT32, struct.pack("<I", int(v)))

    def f32(self, key, v):
        self._add(key, T_FLOAT32, struct.pack("<f", float(v)))

    def boolean(self, key, v):
        self._add(key, T_BOOL, struct.pack("<B", 1 if v else 0))

    def string(self, key, v):
        self._add(key, T_STRING, gguf_str(v))

    def str_array(self, key, values):
        body = b"".join(gguf_str(v) for v in values)
        self._add(key, T_ARRAY, struct.pack("<IQ", T_STRING, len(values)) + body)

    def f32_array(self, key, values):
        arr = np.asarray(values, dtype="<f4")
        self._add(key, T_ARRAY, struct.pack("<IQ", T_FLOAT32, arr.size) + arr.tobytes())

    def i32_array(self, key, values):
        arr = np.asarray(values, dtype="<i4")
        self._add(key, T_ARRAY, struct.pack("<IQ", T_INT32, arr.size) + arr.tobytes())

    def encode(self):
        return b"".join(self.parts)


def to_bf16_bits(x):
    """float32 array -> uint16 bf16 bit patterns (round to nearest even)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def make_pool(dtype, seed):
    rng = np.random.default_rng(seed)
    if dtype not in ("bf16", "f16"):
        return memoryview(rng.integers(0, 256, 2 * POOL_ELEMS, dtype=np.uint8).tobytes())
    x = rng.standard_normal(POOL_ELEMS, dtype=np.float32) * np.float32(0.02)
    if dtype == "bf16":
        bits = to_bf16_bits(x)
    else:
        bits = x.astype("<f2")
    return memoryview(bits.tobytes())


def llama3_rope_factors(cfg, head_dim, theta):
    """Per-frequency divisors for Llama 3.x "llama3" rope scaling (None when not configured)."""
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type")) != "llama3":
        return None
    factor = float(rs.get("factor", 8.0))
    low = float(rs.get("low_freq_factor", 1.0))
    high = float(rs.get("high_freq_factor", 4.0))
    old_ctx = float(rs.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (theta ** (i / head_dim))
        wavelen = 2.0 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return np.asarray(out, dtype="<f4")


def tokenizer(meta, n_vocab):
    if n_vocab < 259 + 1:
        sys.exit(f"vocab_size {n_vocab} too small for the synthetic SPM vocab (needs >= 260)")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOK_UNKNOWN, TOK_CONTROL, TOK_CONTROL] + [TOK_BYTE] * 256
    n_fill = n_vocab - len(tokens)
    tokens += [f"\u2581t{i}" for i in range(n_fill)]
    types += [TOK_NORMAL] * n_fill
    scores = np.zeros(n_vocab, dtype="<f4")
    scores[259:] = -np.arange(n_fill, dtype=np.float32)
    meta.string("tokenizer.ggml.model", "llama")
    meta.str_array("tokenizer.ggml.tokens", tokens)
    meta.f32_array("tokenizer.ggml.scores", scores)
    meta.i32_array("tokenizer.ggml.token_type", types)
    meta.u32("tokenizer.ggml.unknown_token_id", 0)
    meta.u32("tokenizer.ggml.bos_token_id", 1)
    meta.u32("tokenizer.ggml.eos_token_id", 2)
    meta.boolean("tokenizer.ggml.add_bos_token", True)
    meta.boolean("tokenizer.ggml.add_eos_token", False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["bf16", "f16", "q8_0", "q4_k_m"], default="bf16")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.time()
    with open(args.config) as f:
        cfg = json.load(f)
    n_embd = int(cfg["hidden_size"])
    n_layer = int(args.layers if args.layers is not None else cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads", n_head))
    head_dim = int(cfg.get("head_dim") or n_embd // n_head)
    n_ff = int(cfg["intermediate_size"])
    n_vocab = int(cfg["vocab_size"])
    n_ctx = int(cfg.get("max_position_embeddings", 8192))
    theta = float(cfg.get("rope_theta", 10000.0))
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    tied = bool(cfg.get("tie_word_embeddings", False))
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        sys.exit("biases are not supported by this generator")

    meta = Meta()
    meta.string("general.architecture", "llama")
    meta.string("general.name", f"strata-random-{cfg.get('model_type', 'llama')}")
    meta.u32("general.file_type", FILE_TYPE[args.dtype])
    meta.u32("general.alignment", ALIGN)
    meta.u32("llama.context_length", n_ctx)
    meta.u32("llama.embedding_length", n_embd)
    meta.u32("llama.block_count", n_layer)
    meta.u32("llama.feed_forward_length", n_ff)
    meta.u32("llama.attention.head_count", n_head)
    meta.u32("llama.attention.head_count_kv", n_kv)
    meta.u32("llama.attention.key_length", head_dim)
    meta.u32("llama.attention.value_length", head_dim)
    meta.f32("llama.rope.freq_base", theta)
    meta.u32("llama.rope.dimension_count", head_dim)
    meta.f32("llama.attention.layer_norm_rms_epsilon", eps)
    meta.u32("llama.vocab_size", n_vocab)
    tokenizer(meta, n_vocab)

    wt = TENSOR_TYPE[args.dtype]
    # Q4_K_M's "more bits" layers (llama.cpp's use_more_bits) take Q6_K for attn_v and ffn_down.
    def more_bits(i):
        return i < n_layer // 8 or i >= 7 * n_layer // 8 or (i - n_layer // 8) % 3 == 2
    wv = lambda i: GGML_Q6_K if args.dtype == "q4_k_m" and more_bits(i) else wt
    wo = GGML_Q6_K if args.dtype == "q4_k_m" else wt
    rope_factors = llama3_rope_factors(cfg, head_dim, theta)
    # (name, dims innermost-first, ggml type, kind): kind "rand", "ones" or an ndarray of f32
    tensors = [("token_embd.weight", (n_embd, n_vocab), wt, "rand")]
    if rope_factors is not None:
        tensors.append(("rope_freqs.weight", (head_dim // 2,), GGML_F32, rope_factors))
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", (n_embd,), GGML_F32, "ones"),
            (p + "attn_q.weight", (n_embd, n_head * head_dim), wt, "rand"),
            (p + "attn_k.weight", (n_embd, n_kv * head_dim), wt, "rand"),
            (p + "attn_v.weight", (n_embd, n_kv * head_dim), wv(i), "rand"),
            (p + "attn_output.weight", (n_head * head_dim, n_embd), wt, "rand"),
            (p + "ffn_norm.weight", (n_embd,), GGML_F32, "ones"),
            (p + "ffn_gate.weight", (n_embd, n_ff), wt, "rand"),
            (p + "ffn_up.weight", (n_embd, n_ff), wt, "rand"),
            (p + "ffn_down.weight", (n_ff, n_embd), wv(i), "rand"),
        ]
    tensors.append(("output_norm.weight", (n_embd,), GGML_F32, "ones"))
    if not tied:
        tensors.append(("output.weight", (n_embd, n_vocab), wo, "rand"))

    def nbytes(dims, t):
        if t in BLOCKS:
            per, size, _ = BLOCKS[t]
            return math.prod(dims) // per * size
        return math.prod(dims) * (4 if t == GGML_F32 else 2)

    def pad(n):
        return (ALIGN - n % ALIGN) % ALIGN

    infos, offset = [], 0
    for name, dims, t, _ in tensors:
        infos.append(gguf_str(name) + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", t, offset))
        offset += nbytes(dims, t)
        offset += pad(offset)
    total = offset

    header = (GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(tensors), meta.count)
              + meta.encode() + b"".join(infos))
    header += b"\0" * pad(len(header))

    pool = make_pool(args.dtype, args.seed)
    pool_len = len(pool)  # bytes
    zeros = bytes(ALIGN)
    with open(args.out, "wb") as f:
        f.write(header)
        for k, (name, dims, t, kind) in enumerate(tensors):
            n = nbytes(dims, t)
            if isinstance(kind, np.ndarray):
                f.write(kind.astype("<f4").tobytes())
            elif kind == "ones":
                f.write(np.ones(math.prod(dims), dtype="<f4").tobytes())
            else:
                # start each tensor at a different (even) pool offset so tensors differ
                pos = ((k * 2654435761) % (pool_len // 2)) * 2
                left = n
                scales = BLOCKS.get(t, (0, 0, []))
                while left:
                    if scales[1]:
                        # whole blocks from the pool, each with its scales set
                        size = scales[1]
                        take = min(left, (pool_len - pos) // size * size, (64 << 20) // size * size)
                        if take == 0:
                            pos = 0
                            continue
                        blocks = np.frombuffer(pool[pos:pos + take], dtype=np.uint8)
                        blocks = blocks.reshape(-1, size).copy()
                        for at, value in scales[2]:
                            blocks[:, at:at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
                        if t == GGML_Q6_K:
                            blocks[:, 192:208] &= 0x1F  # signed scales 0..31
                        f.write(blocks.tobytes())
                        left -= take
                        pos += take
                        continue
                    chunk = pool[pos:pos + left]
                    f.write(chunk)
                    left -= len(chunk)
                    pos = 0
            f.write(zeros[:pad(n)])
    dt = time.time() - t0
    print(f"wrote {args.out}: {len(tensors)} tensors, {n_layer} layers, vocab {n_vocab}, "
          f"{args.dtype}, {(len(header) + total) / 1e9:.2f} GB in {dt:.1f} s")


if __name__ == "__main__":
    main()
