"""PyTorch eager peer for the decode and prefill benchmarks (run on the GPU machine by
scripts/device/battery.sh): the same config.json shape with random bf16 weights, transformers'
own model class, greedy decode with its dynamic KV cache, timed with CUDA synchronisation.

Usage: torch_peer.py CONFIG.json OUT.json [--batch 1,8,32,64] [--context 512] [--steps 32]
                     [--prompt 512,4096]
"""

import argparse
import json
import statistics
import time

import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--batch", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", default="512,4096")
    args = parser.parse_args()

    config = transformers.AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.eval()
    vocab = config.vocab_size
    result = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(),
        "config": args.config,
        "decode": [],
        "prefill": [],
    }
    with torch.inference_mode():
        for batch in [int(b) for b in args.batch.split(",")]:
            ids = torch.randint(0, vocab, (batch, args.context), device="cuda")
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
            times = []
            for step in range(args.steps + 4):
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = model(token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if step >= 4:
                    times.append(time.perf_counter() - start)
            med = statistics.median(times)
            result["decode"].append(
                {"batch": batch, "step_ms": med * 1e3, "tokens_per_s": batch / med,
                 "runs": len(times)}
            )
            print(f"torch decode batch {batch}: {med * 1e3:.2f} ms/step, {batch / med:.0f} tok/s")
            del cache, out
            torch.cuda.empty_cache()
        for n in [int(p) for p in args.prompt.split(",")]:
            ids = torch.randint(0, vocab, (1, n), device="cuda")
            times = []
            for run in range(6):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model(ids, use_cache=True, logits_to_keep=1)
                torch.cuda.synchronize()
                if run >= 2:
                    times.append(time.perf_counter() - start)
            med = statistics.median(times)
            result["prefill"].append({"prompt": n, "ms": med * 1e3, "tokens_per_s": n / med})
            print(f"torch prefill {n}: {med * 1e3:.2f} ms, {n / med:.0f} tok/s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
