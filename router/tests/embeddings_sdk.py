"""Drives `/v1/embeddings` of a live `strata serve` with the official `openai` SDK (3.x), and
`/v2/rerank` with the official `cohere` SDK (its ClientV2), each unmodified.

Run by router/tests/embeddings_sdk.rs twice: `--sdk openai` with the openai packages on the
path, `--sdk cohere` with cohere's (kept in a folder of their own). Every check asserts
something a broken server would fail; the first failure exits non-zero with its reason.
"""

import argparse
import math


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def openai_checks(base_url, model, api_key):
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120)
    texts = ["The cat sat on the mat.", "Rain in Spain", "The cat sat on the mat."]
    # The SDK asks for base64 unless told otherwise, and decodes it.
    out = client.embeddings.create(model=model, input=texts)
    assert out.object == "list" and out.model == model, out
    assert [d.index for d in out.data] == [0, 1, 2], out.data
    vectors = [d.embedding for d in out.data]
    dim = len(vectors[0])
    assert dim > 8 and all(len(v) == dim for v in vectors), [len(v) for v in vectors]
    assert all(abs(norm(v) - 1.0) < 1e-5 for v in vectors), [norm(v) for v in vectors]
    assert vectors[0] == vectors[2] and vectors[0] != vectors[1]
    assert out.usage.prompt_tokens > 0 and out.usage.total_tokens == out.usage.prompt_tokens, out.usage
    # Floats as JSON: the same values.
    floats = client.embeddings.create(model=model, input=texts[0], encoding_format="float")
    assert all(abs(a - b) < 1e-6 for a, b in zip(floats.data[0].embedding, vectors[0]))
    # dimensions: the leading values, renormalized.
    short = client.embeddings.create(model=model, input=texts[0], dimensions=8).data[0].embedding
    head = norm(vectors[0][:8])
    assert len(short) == 8 and all(abs(s - v / head) < 1e-5 for s, v in zip(short, vectors[0])), short
    # Refusals are the SDK's typed errors, naming the field.
    try:
        client.embeddings.create(model=model, input=texts[0], dimensions=dim + 1)
        raise AssertionError("dimensions beyond the model's were accepted")
    except openai.BadRequestError as e:
        assert "dimensions" in str(e), e
    try:
        client.embeddings.create(model="no-such-model", input="x")
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError:
        pass
    print(f"openai embeddings: {len(vectors)} vectors of {dim}, base64 == float, dimensions ok")


def cohere_checks(base_url, model, api_key):
    import cohere

    client = cohere.ClientV2(api_key=api_key, base_url=base_url, timeout=120)
    query = "where did the cat sit"
    documents = ["dogs bark at night", query, "rain falls mainly on the plain"]
    out = client.rerank(model=model, query=query, documents=documents)
    results = out.results
    assert len(results) == 3, out
    assert results[0].index == 1, [r.index for r in results]
    assert abs(results[0].relevance_score - 1.0) < 1e-5, results[0]
    scores = [r.relevance_score for r in results]
    assert scores == sorted(scores, reverse=True), scores
    assert sorted(r.index for r in results) == [0, 1, 2]
    top = client.rerank(model=model, query=query, documents=documents, top_n=2, max_tokens_per_doc=64)
    assert [r.index for r in top.results] == [r.index for r in results[:2]], top
    try:
        client.rerank(model=model, query=query, documents=[])
        raise AssertionError("an empty document list was accepted")
    except cohere.errors.BadRequestError as e:
        assert "documents" in str(e), e
    print(f"cohere rerank: {len(results)} documents ranked, top_n ok")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sdk", required=True, choices=["openai", "cohere"])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int, required=True)
    parser.add_argument("--alias", action="append", default=[])
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    check = openai_checks if args.sdk == "openai" else cohere_checks
    check(args.base_url, args.model, args.api_key)


if __name__ == "__main__":
    main()
