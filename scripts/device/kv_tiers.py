"""Drives one phase of scripts/device/kv_tiers.sh against a running `strata serve`.

host / disk: a CONTEXT-token prompt computed cold (TTFT with one output token = the recompute
cost), continued greedily (32 tokens, its KV still on the device), pushed down a tier by other
prompts (three of the same length by default), asked again (TTFT = the restore), pushed down again
and continued greedily (must equal the first continuation byte for byte). disk-restarted: the
server was SIGKILLed and started again on the same disk tier: the context is restored from what
the disk kept. long: the host phase with a long context (128k tokens) pushed by shorter prompts.
The restore rate is read from /metrics (bytes restored / restore time per tier).
Writes the phase's numbers as JSON; exits non-zero if a check failed.
"""

import argparse
import json
import random
import re
import time
import urllib.request



def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


MODEL = "strata-kv-8b"


def complete(url: str, prompt: list, max_tokens: int) -> tuple:
    started = time.perf_counter()
    answer = post(url, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True})
    elapsed = time.perf_counter() - started
    usage = answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return answer["choices"][0]["text"], elapsed, cached


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as answer:
        text = answer.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            # Every strata_ sample carries model_name first; keyed without it.
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            values[name] = float(value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--phase", required=True, choices=["host", "disk", "disk-restarted", "long"])
    parser.add_argument("--pinned-gbs", type=float, required=True,
                        help="pinned host-to-device copy rate measured on this machine")
    parser.add_argument("--push", type=int, default=3, help="prompts that push the context down")
    parser.add_argument("--push-context", type=int, help="their length (default: --context)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--vocab", type=int, default=120000, help="token ids drawn below this")
    parser.add_argument("--model", default="strata-kv-8b")
    args = parser.parse_args()
    global MODEL
    url, n, MODEL = args.url, args.context, args.model
    tier = "disk" if args.phase.startswith("disk") else "host"
    rng = random.Random(21)
    draw = lambda k: [rng.randrange(args.vocab // 100, args.vocab) for _ in range(k)]
    context = draw(n)
    others = [draw(args.push_context or n) for _ in range(2 * args.push)]
    result = {"phase": args.phase, "context_tokens": n}
    ok = True

    def push(batch: list) -> None:
        for prompt in batch:
            complete(url, prompt, 1)

    if args.phase != "disk-restarted":
        _, cold, cached = complete(url, context, 1)
        result["ttft_cold_s"] = round(cold, 3)
        assert cached == 0, cached
        first, _, _ = complete(url, context, 32)
        push(others[:args.push])
    before = metrics(url)
    _, parked, cached = complete(url, context, 1)
    after = metrics(url)
    result[f"ttft_parked_{tier}_s"] = round(parked, 3)
    result["cached_tokens"] = cached
    restored = after.get(f'strata_kv_restored_bytes_total{{tier="{tier}"}}', 0) - before.get(
        f'strata_kv_restored_bytes_total{{tier="{tier}"}}', 0)
    seconds = after.get(f'strata_kv_restore_seconds_total{{tier="{tier}"}}', 0) - before.get(
        f'strata_kv_restore_seconds_total{{tier="{tier}"}}', 0)
    result["restored_gib"] = round(restored / 2**30, 3)
    # The engine thread's time in the restores (disk reads, and queueing the copies: they run on
    # the copy streams after it returns).
    result["engine_restore_s"] = round(seconds, 4)
    # What the request saw: every restored byte over the whole TTFT (which also computes the
    # last block and answers over HTTP), a lower bound on the copy rate.
    rate = restored / parked / 1e9
    result[f"effective_restore_{tier}_gbs"] = round(rate, 2)
    if tier == "host":
        result["pinned_pcie_gbs"] = args.pinned_gbs
        result["fraction_of_pinned_pcie"] = round(rate / args.pinned_gbs, 3)
        if seconds > 0:
            result["engine_restore_gbs"] = round(restored / seconds / 1e9, 2)
    # The same request again, its context now on the device: what the request costs without a
    # restore (the last partial block, the first token at this context, HTTP). The difference is
    # the restore's own time.
    _, resident, _ = complete(url, context, 1)
    result["ttft_resident_s"] = round(resident, 3)
    if parked > resident:
        restore_rate = restored / (parked - resident) / 1e9
        result[f"restore_{tier}_gbs"] = round(restore_rate, 2)
        if tier == "host":
            result["restore_fraction_of_pinned_pcie"] = round(restore_rate / args.pinned_gbs, 3)
    if "ttft_cold_s" in result and parked > 0:
        result["recompute_over_restore"] = round(result["ttft_cold_s"] / parked, 2)
    if cached < n // 2:
        print(f"FAILED: only {cached} of {n} tokens came from the {tier} tier")
        ok = False
    if args.phase != "disk-restarted":
        push(others[args.push:])
        again, _, cached_again = complete(url, context, 32)
        result["continuation_identical"] = again == first
        result["cached_tokens_continuation"] = cached_again
        if again != first:
            print("FAILED: the restored continuation differs from the never-evicted one")
            ok = False
        if args.phase == "disk":
            # Down to disk once more, every block of it (a chain is evicted tail first), so the
            # restarted server finds the context there.
            push(others)
    for key in ("host", "disk"):
        capacity = after.get(f'strata_kv_tier_capacity_blocks{{tier="{key}"}}')
        if capacity is not None:
            result[f"{key}_capacity_blocks"] = capacity
    result["copy_failures"] = after.get("strata_kv_tier_copy_failures_total", 0)
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
