#!/usr/bin/env python3
"""Writes the GGUF mixture-of-experts fixture and its transformers logits (issue 38).

    python3 tests/oracle/gguf_moe/make_fixture.py   # needs numpy, gguf, torch, transformers

A Qwen3-MoE-shaped file (`general.architecture` qwen3moe, 2 layers, hidden 256, 4 experts of which
2 per token, 64 wide) written by the `gguf` package's GGUFWriter, with llama.cpp's stacked expert
tensors: `ffn_gate_exps` / `ffn_up_exps` in Q4_K (random blocks: gguf-py has no Q4_K quantizer),
`ffn_down_exps`, the attention and the embedding in Q8_0 (quantized by gguf-py), norms and the
router in F32. transformers loads the file itself (`gguf_file=`, dequantized to float32, eager
attention; `moe_intermediate_size` passed, which its GGUF config map does not read) and its logits
at five positions of three prompts go into qwen3moe.logits.safetensors beside the file.
model/tests/gguf_moe.rs checks the CPU reference against them.
"""

import pathlib
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import quants

HERE = pathlib.Path(__file__).parent
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 96, 256, 2, 2, 1, 64
EXPERTS, USED, EXPERT_WIDTH = 4, 2, 64
PROMPTS = [[1, 5, 9, 44, 2, 70, 13], [3] + list(range(10, 33)), [7, 90, 91, 92, 0, 61, 8, 8, 8, 40]]


def q4_k_blocks(rng, rows, cols):
    """Random Q4_K blocks with fixed scales: d and dmin as f16 so weights are ~0.05."""
    blocks = rows * cols // 256
    raw = rng.integers(0, 256, size=(blocks, 144), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    raw[:, 2:4] = np.frombuffer(np.float16(0.001).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, cols // 256 * 144)


def write_gguf(path, rng):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(EXPERT_WIDTH)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def normal(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def q8(name, x):
        w.add_tensor(name, quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)

    def f32(name, x):
        w.add_tensor(name, x)

    q8("token_embd.weight", normal(VOCAB, HIDDEN, scale=0.5))
    q8("output.weight", normal(VOCAB, HIDDEN, scale=0.1))
    f32("output_norm.weight", 1.0 + normal(HIDDEN, scale=0.1))
    for i in range(LAYERS):
        p = f"blk.{i}."
        f32(p + "attn_norm.weight", 1.0 + normal(HIDDEN, scale=0.1))
        q8(p + "attn_q.weight", normal(HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5))
        q8(p + "attn_k.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5))
        q8(p + "attn_v.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN, scale=HIDDEN ** -0.5))
        q8(p + "attn_output.weight", normal(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5))
        f32(p + "attn_q_norm.weight", 1.0 + normal(HEAD_DIM, scale=0.1))
        f32(p + "attn_k_norm.weight", 1.0 + normal(HEAD_DIM, scale=0.1))
        f32(p + "ffn_norm.weight", 1.0 + normal(HIDDEN, scale=0.1))
        f32(p + "ffn_gate_inp.weight", normal(EXPERTS, HIDDEN, scale=0.2))
        for proj in ("gate", "up"):
            stacked = np.stack([q4_k_blocks(rng, EXPERT_WIDTH, HIDDEN) for _ in range(EXPERTS)])
            w.add_tensor(p + f"ffn_{proj}_exps.weight", stacked, raw_dtype=Q.Q4_K)
        down = np.stack([quants.quantize(normal(HIDDEN, EXPERT_WIDTH, scale=EXPERT_WIDTH ** -0.5), Q.Q8_0)
                         for _ in range(EXPERTS)])
        w.add_tensor(p + "ffn_down_exps.weight", down, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(path):
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.moe_intermediate_size = EXPERT_WIDTH
    config.norm_topk_prob = True
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, config=config, dtype=torch.float32,
        attn_implementation="eager").eval()
    tensors = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            out = model(input_ids=torch.tensor([prompt])).logits[0].float()
            n = len(prompt)
            pos = sorted({0, 1, n // 2, n - 2, n - 1})
            tensors[f"prompt{i}.positions"] = torch.tensor(pos, dtype=torch.int64)
            tensors[f"prompt{i}.tokens"] = torch.tensor(prompt, dtype=torch.int64)
            tensors[f"prompt{i}.logits"] = out[pos].contiguous()
    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "gguf": gguf.__version__ if hasattr(gguf, "__version__") else "unknown",
            "dtype": "float32", "attn_implementation": "eager"}
    save_file(tensors, str(HERE / "qwen3moe.logits.safetensors"), metadata=meta)


def main():
    rng = np.random.default_rng(38)
    path = HERE / "qwen3moe-q4k-q8.gguf"
    write_gguf(path, rng)
    logits(path)
    print(f"{path}: {path.stat().st_size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
