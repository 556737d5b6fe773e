"""The official `openai` SDK against two live servers of one model: `--plain-url` decoding
plainly, `--spec-url` with n-gram speculative decoding. Every request is streamed from both and
the chunks must be the same: each choice's text pieces in order, their log-probabilities and the
finish reason. The speculating server's /metrics must show proposals accepted, so the comparison
is not between two plain servers.

Run by router/tests/openai_spec.rs; the first difference exits non-zero naming it.
"""

import argparse
import json
import re
import urllib.request

import openai


def chat_chunks(client, model, **kwargs):
    """(choice index, content piece, logprobs, finish reason) of each streamed choice delta."""
    out = []
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        for c in chunk.choices:
            lp = None
            if c.logprobs is not None and c.logprobs.content is not None:
                lp = [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                      for t in c.logprobs.content]
            out.append((c.index, c.delta.content, lp, c.finish_reason))
    return out


def completion_chunks(client, model, **kwargs):
    out = []
    for chunk in client.completions.create(model=model, stream=True, **kwargs):
        for c in chunk.choices:
            lp = None
            if c.logprobs is not None:
                lp = (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.text_offset)
            out.append((c.index, c.text, lp, c.finish_reason))
    return out


def accepted(base_url):
    text = urllib.request.urlopen(base_url + "/metrics", timeout=30).read().decode()
    m = re.search(r"^strata_spec_decode_num_accepted_tokens_total\{[^}]*\} (\d+)", text, re.M)
    return int(m.group(1)) if m else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain-url", required=True)
    parser.add_argument("--spec-url", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    plain = openai.OpenAI(base_url=args.plain_url + "/v1", api_key="unused", max_retries=0,
                          timeout=120)
    spec = openai.OpenAI(base_url=args.spec_url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)
    model = args.model
    copy = ("Repeat after me: the quick brown fox jumps over the lazy dog, "
            "the quick brown fox jumps over the lazy dog, the quick brown fox")
    messages = [{"role": "user", "content": copy}]
    cases = [
        ("chat greedy with logprobs", chat_chunks,
         dict(messages=messages, max_tokens=48, temperature=0, logprobs=True, top_logprobs=2)),
        ("chat seeded sampling", chat_chunks,
         dict(messages=messages, max_tokens=48, temperature=0.9, top_p=0.95, seed=11)),
        ("chat n=2 seeded", chat_chunks,
         dict(messages=messages, max_tokens=32, temperature=0.8, seed=3, n=2)),
        ("chat with a penalty and a stop string", chat_chunks,
         dict(messages=messages, max_tokens=48, temperature=0, frequency_penalty=0.3,
              stop=["ox"])),
        ("completion greedy with logprobs", completion_chunks,
         dict(prompt=copy, max_tokens=48, temperature=0, logprobs=2)),
        ("completion seeded sampling", completion_chunks,
         dict(prompt=copy, max_tokens=48, temperature=0.7, seed=5)),
    ]
    for name, run, kwargs in cases:
        # Each choice's chunks in order (choices of n > 1 interleave as their steps come).
        a = sorted(run(plain, model, **kwargs), key=lambda c: c[0])
        b = sorted(run(spec, model, **kwargs), key=lambda c: c[0])
        assert len(a) > 2, f"{name}: too few chunks: {a}"
        assert a == b, f"{name}: speculative stream differs\nplain: {json.dumps(a)}\nspec:  {json.dumps(b)}"
        finish = [c[3] for c in a if c[3] is not None]
        assert finish, f"{name}: no finish_reason"
    n = accepted(args.spec_url)
    assert n > 0, f"the speculating server accepted no proposal ({n})"
    assert accepted(args.plain_url) == 0, "the plain server speculated"
    print(f"ok: {len(cases)} streams identical; {n} proposed tokens accepted")


if __name__ == "__main__":
    main()
