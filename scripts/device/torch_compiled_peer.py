"""Compiled PyTorch decoder: the decode peer issue 17 measures strata's batched decode against.

A Llama-shaped decoder written directly in PyTorch (no transformers): random bf16 weights of a
config.json shape, a static KV cache sized for the whole run, the decoder layer compiled once with
torch.compile (inductor) and reused by every layer, and the whole decode step (every layer, the
final norm, the LM head) captured into one CUDA graph per batch size. Every row sits at the same
position (the prompt length), as in `strata gpu decode`; attention reads the static cache through
a mask, so shapes never change between steps. Times come from CUDA events around graph replays
after a warm-up; the median is reported with the bytes a step must move (weights plus the KV read).

Usage: torch_compiled_peer.py CONFIG.json OUT.json [--batch 1,32,64] [--context 512]
                              [--steps 64] [--bandwidth BYTES_PER_S]
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def copy_rate():
    """A device-to-device copy of 1 GiB, bytes read plus written per second, the best of five
    after one warm-up: the roofline `strata gpu decode` measures the same way."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i > 0:
            best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2.0 * (1 << 30) / best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--batch", default="1,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s for the roofline; default: measured here, as strata gpu decode does")
    args = parser.parse_args()
    if args.bandwidth is None:
        args.bandwidth = copy_rate()

    cfg = json.load(open(args.config))
    h = cfg["hidden_size"]
    n_layers = cfg["num_hidden_layers"]
    nh = cfg["num_attention_heads"]
    kvh = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim") or h // nh
    inter = cfg["intermediate_size"]
    vocab = cfg["vocab_size"]
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    theta = float(cfg.get("rope_theta", 10000.0))
    dev, dt = "cuda", torch.bfloat16
    max_len = args.context + args.steps + 32

    gen = torch.Generator(device=dev).manual_seed(0)

    def weight(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen) * 0.02

    layers = [
        {
            "qkv": weight((nh + 2 * kvh) * hd, h),
            "o": weight(h, nh * hd),
            "gate_up": weight(2 * inter, h),
            "down": weight(h, inter),
            "n1": torch.ones(h, device=dev, dtype=dt),
            "n2": torch.ones(h, device=dev, dtype=dt),
        }
        for _ in range(n_layers)
    ]
    embed = weight(vocab, h)
    head = weight(vocab, h)
    final_norm = torch.ones(h, device=dev, dtype=dt)
    weight_bytes = sum(t.numel() * 2 for lw in layers for t in lw.values())
    weight_bytes += (embed.numel() + head.numel() + final_norm.numel()) * 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt) * w

    def rope(x, pos):
        f = pos.float() * inv_freq
        cos, sin = f.cos(), f.sin()
        x1, x2 = x[..., : hd // 2].float(), x[..., hd // 2 :].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(dt)

    def layer(x, qkv_w, o_w, gu_w, down_w, n1, n2, kc, vc, pos, mask):
        b = x.shape[0]
        y = rms(x, n1) @ qkv_w.t()
        q, k, v = y.split([nh * hd, kvh * hd, kvh * hd], -1)
        q = rope(q.view(b, nh, 1, hd), pos)
        k = rope(k.view(b, kvh, 1, hd), pos)
        kc.index_copy_(2, pos, k)
        vc.index_copy_(2, pos, v.view(b, kvh, 1, hd))
        a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        x = x + a.reshape(b, nh * hd) @ o_w.t()
        gate, up = (rms(x, n2) @ gu_w.t()).chunk(2, -1)
        return x + (F.silu(gate) * up) @ down_w.t()

    compiled = torch.compile(layer, dynamic=False)
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "config": args.config,
        "context": args.context,
        "weight_bytes": weight_bytes,
        "bandwidth_bytes_per_s": args.bandwidth,
        "method": "hand-written Llama decoder, static KV cache, torch.compile per layer, one CUDA graph per step",
        "decode": [],
    }
    for batch in [int(b) for b in args.batch.split(",")]:
        caches = [
            (
                torch.zeros(batch, kvh, max_len, hd, device=dev, dtype=dt),
                torch.zeros(batch, kvh, max_len, hd, device=dev, dtype=dt),
            )
            for _ in range(n_layers)
        ]
        for kc, vc in caches:  # a filled context: random keys and values
            kc[:, :, : args.context].normal_(0, 1, generator=gen)
            vc[:, :, : args.context].normal_(0, 1, generator=gen)
        tokens = torch.randint(0, vocab, (batch,), device=dev, generator=gen)
        pos = torch.tensor([args.context], device=dev, dtype=torch.long)
        mask = torch.zeros(1, 1, 1, max_len, device=dev, dtype=torch.bool)
        logits = torch.empty(batch, vocab, device=dev, dtype=torch.float32)

        def step():
            mask.copy_((torch.arange(max_len, device=dev) <= pos)[None, None, None, :])
            x = embed[tokens]
            for lw, (kc, vc) in zip(layers, caches):
                x = compiled(
                    x, lw["qkv"], lw["o"], lw["gate_up"], lw["down"], lw["n1"], lw["n2"],
                    kc, vc, pos, mask,
                )
            logits.copy_((rms(x, final_norm) @ head.t()).float())
            tokens.copy_(logits.argmax(-1))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compile and warm up outside the capture
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(5):
            graph.replay()
        times = []
        for _ in range(args.steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        med = statistics.median(times)
        kv_bytes = batch * (args.context + 1) * n_layers * 2 * kvh * hd * 2
        ideal = (weight_bytes + kv_bytes) / args.bandwidth
        row = {
            "batch": batch,
            "step_ms": {"min": min(times) * 1e3, "median": med * 1e3, "max": max(times) * 1e3},
            "tokens_per_s": batch / med,
            "roofline_ms": ideal * 1e3,
            "roofline_fraction": ideal / med,
            "runs": args.steps,
        }
        print(
            f"compiled torch batch {batch:>3}: step {med * 1e3:.3f} ms, {batch / med:.0f} tok/s, "
            f"{100 * ideal / med:.1f} % of the roofline",
            flush=True,
        )
        result["decode"].append(row)
        del graph, caches
        torch.cuda.empty_cache()
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
