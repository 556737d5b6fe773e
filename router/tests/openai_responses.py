"""Drives a live `strata serve`'s /v1/responses with the official `openai` Python SDK, unmodified.

Run by router/tests/openai_responses.rs, which starts the server and passes its address. Every
check asserts something a broken server would fail; the first failure exits non-zero with its
reason.
"""

import argparse
import json

import openai

try:  # the current SDK majors (openai 3.x, anthropic 2.x) bring httpx2, older ones httpx
    import httpx2 as httpx
except ImportError:
    import httpx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int, required=True)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    model = args.model

    # Non-streaming: text, usage, and a status that matches the reason it ended.
    first = client.responses.create(
        model=model,
        instructions="Be brief.",
        input="Name three prime numbers.",
        max_output_tokens=16,
        temperature=0,
    )
    assert first.object == "response", first
    assert first.id.startswith("resp_"), first.id
    assert first.output_text, first
    assert first.status in ("completed", "incomplete"), first
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens", first
    usage = first.usage
    assert usage is not None and usage.input_tokens > 0 and usage.output_tokens > 0, usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens, usage
    assert first.instructions == "Be brief.", first.instructions

    # The stored response can be fetched back.
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text, (fetched, first)

    # A follow-up continues the stored conversation: the server prepends it, so the prompt grows.
    second = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "And two more?"}]}],
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id, second
    assert second.output_text, second
    assert second.usage.input_tokens > usage.input_tokens, (second.usage, usage)

    # store=False: answered, but not continuable.
    unstored = client.responses.create(
        model=model, input="Hello", max_output_tokens=4, temperature=0, store=False
    )
    try:
        client.responses.create(
            model=model, input="again", previous_response_id=unstored.id, max_output_tokens=4
        )
        raise AssertionError("a store=False response was continued")
    except openai.NotFoundError as e:
        assert e.body.get("param") == "previous_response_id", e.body

    # Streaming: the deltas concatenate to the greedy non-streaming text, in sequence order,
    # ending with response.completed (or response.incomplete) carrying usage.
    stream = client.responses.create(
        model=model,
        instructions="Be brief.",
        input="Name three prime numbers.",
        max_output_tokens=16,
        temperature=0,
        stream=True,
    )
    kinds, pieces, sequence = [], [], []
    for event in stream:
        kinds.append(event.type)
        sequence.append(event.sequence_number)
        if event.type == "response.output_text.delta":
            pieces.append(event.delta)
    assert sequence == list(range(len(sequence))), sequence
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ], kinds
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "".join(pieces) == first.output_text, ("".join(pieces), first.output_text)
    final = event.response
    assert final.output_text == first.output_text, final
    assert final.usage.output_tokens == usage.output_tokens, (final.usage, usage)

    # The wire format: named events, each `event: <type>` then `data: <json>` with that type.
    raw = httpx.post(
        f"{args.base_url}/responses",
        json={"model": model, "input": "Hi", "max_output_tokens": 2, "stream": True},
        timeout=120,
    )
    assert raw.headers["content-type"].startswith("text/event-stream"), raw.headers
    frames = [f for f in raw.text.split("\n\n") if f.strip()]
    assert frames[0].startswith("event: response.created\ndata: {"), frames[0]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        kind = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == kind, frame

    # Refusals map to the SDK's exception types.
    try:
        client.responses.create(model=model, input="hi", previous_response_id="resp_nope")
        raise AssertionError("an unknown previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert "resp_nope" in str(e), e
        assert e.body.get("param") == "previous_response_id", e.body
    try:
        client.responses.create(model="no-such-model", input="hi")
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e

    print("openai SDK", openai.__version__, "responses ok")


if __name__ == "__main__":
    main()
