#!/usr/bin/env python3
"""A serving benchmark against any OpenAI-compatible endpoint, standard library only (it runs on
the GPU machine, where nothing can be installed).

Closed loop: N workers, each keeping one streamed `/v1/completions` request in flight on its own
keep-alive HTTP/1.1 connection (what SDKs do), or a fresh connection per request
(`--connection fresh`). Prompts are distinct arrays of random token ids, so their lengths are
exact without a tokenizer; `ignore_eos` and `min_tokens` fix the output length. Per point:
output tokens/s, TTFT / ITL / TPOT / end-to-end percentiles (linear interpolation), failures.

  serve_load.py --url http://127.0.0.1:8080 --concurrency 1,16,64 --input-len 512 \
      --output-len 128 --json out.json
"""
import argparse
import asyncio
import json
import random
import socket
import sys
import time
import urllib.parse


def percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    at = (len(v) - 1) * q / 100.0
    lo = int(at)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (at - lo)


def summary(values, scale=1.0):
    if not values:
        return None
    return {
        "mean": scale * sum(values) / len(values),
        "p50": scale * percentile(values, 50),
        "p90": scale * percentile(values, 90),
        "p99": scale * percentile(values, 99),
    }


class Connection:
    """One HTTP/1.1 keep-alive connection with TCP_NODELAY."""

    def __init__(self, host, port):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def open(self):
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self):
        if self.writer:
            self.writer.close()
        self.reader = self.writer = None

    async def stream(self, path, body, headers):
        """Sends a POST; yields the body's bytes as they arrive (chunked or sized)."""
        if self.writer is None:
            await self.open()
        data = json.dumps(body).encode()
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Content-Type: application/json", f"Content-Length: {len(data)}",
                "Accept: text/event-stream", "Connection: keep-alive"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("connection closed before a response")
        status = int(status_line.split()[1])
        fields = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode().partition(":")
            fields[k.strip().lower()] = v.strip()
        if fields.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    break
                chunk = await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                yield status, chunk
        else:
            n = int(fields.get("content-length", "0"))
            yield status, await self.reader.readexactly(n)
        if fields.get("connection", "").lower() == "close":
            self.close()


async def one_request(conn, args, prompt, model):
    body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "min_tokens": args.output_len}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    start = time.perf_counter()
    arrivals, usage, buffer, done, status, error = [], None, b"", False, None, None
    try:
        async for status, chunk in conn.stream("/v1/completions", body, headers):
            if status != 200:
                error = f"HTTP {status}: {chunk[:300]!r}"
                continue
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                if event.get("usage"):
                    usage = event["usage"]
                choices = event.get("choices") or []
                if choices and choices[0].get("text"):
                    arrivals.append(time.perf_counter())
    except Exception as e:  # a broken connection is a failed request, never a crash
        conn.close()
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if error is None and not done:
        error = "the stream ended without [DONE]"
    if error:
        return {"error": error}
    completion = usage["completion_tokens"] if usage else len(arrivals)
    ttft = arrivals[0] - start if arrivals else None
    return {"ttft": ttft, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "e2e": end - start, "completion_tokens": completion,
            "prompt_tokens": usage["prompt_tokens"] if usage else len(prompt),
            "tpot": (end - start - ttft) / (completion - 1) if ttft and completion > 1 else None}


def prompts(args, n, salt):
    rng = random.Random(args.seed * 1_000_003 + salt)
    prefixes = [[rng.randrange(10, args.vocab_size) for _ in range(args.prefix_len)]
                for _ in range(args.prefix_groups)]
    out = []
    for i in range(n):
        own = [rng.randrange(10, args.vocab_size) for _ in range(args.input_len)]
        out.append(prefixes[i % args.prefix_groups] + own if args.prefix_len else own)
    return out


async def run_point(args, host, port, model, concurrency):
    n = args.num_prompts or max(4 * concurrency, 16)
    queue = prompts(args, n + args.warmup, concurrency)
    warm = Connection(host, port)
    for p in queue[:args.warmup]:
        await one_request(warm, args, p, model)
    warm.close()
    work = list(queue[args.warmup:])
    results = []

    async def worker():
        conn = Connection(host, port)
        while work:
            prompt = work.pop()
            if args.connection == "fresh":
                conn.close()
            results.append(await one_request(conn, args, prompt, model))
        conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    duration = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    failed = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "concurrency": concurrency, "connection": args.connection, "duration_s": duration,
        "completed": len(ok), "failed": len(failed), "errors": failed[:5],
        "input_tokens": sum(r["prompt_tokens"] for r in ok), "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration, "requests_per_s": len(ok) / duration,
        "ttft_ms": summary([r["ttft"] for r in ok if r["ttft"] is not None], 1e3),
        "itl_ms": summary([g for r in ok for g in r["itl"]], 1e3),
        "tpot_ms": summary([r["tpot"] for r in ok if r["tpot"] is not None], 1e3),
        "e2e_ms": summary([r["e2e"] for r in ok], 1e3),
    }


async def first_model(host, port, api_key):
    reader, writer = await asyncio.open_connection(host, port)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode())
    raw = await reader.read()
    writer.close()
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]


async def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model")
    ap.add_argument("--api-key")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--num-prompts", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=0)
    ap.add_argument("--prefix-groups", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--connection", choices=["reuse", "fresh"], default="reuse")
    ap.add_argument("--label", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    url = urllib.parse.urlparse(args.url)
    if url.scheme != "http":
        sys.exit(f"only http:// endpoints are supported, got {args.url}")
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.input_len < 1 or args.output_len < 1:
        sys.exit("concurrency, input and output lengths must be at least 1")
    host, port = url.hostname, url.port or 80
    model = args.model or await first_model(host, port, args.api_key)
    points = []
    for c in levels:
        p = await run_point(args, host, port, model, c)
        points.append(p)
        t, i = p["ttft_ms"] or {}, p["itl_ms"] or {}
        print(f"c={c:<4} {p['output_tokens_per_s']:9.1f} out tok/s  TTFT p50 {t.get('p50', 0):8.1f} "
              f"p99 {t.get('p99', 0):8.1f} ms  ITL p50 {i.get('p50', 0):7.2f} p99 {i.get('p99', 0):7.2f} ms  "
              f"{p['completed']} ok {p['failed']} failed", flush=True)
    report = {"tool": "scripts/bench/serve_load.py", "label": args.label, "args": vars(args),
              "model": model, "started_at": time.time(), "points": points}
    if args.json:
        json.dump(report, open(args.json, "w"), indent=2)
    if any(p["completed"] == 0 for p in points):
        sys.exit("a point had no successful request")


if __name__ == "__main__":
    asyncio.run(main())
