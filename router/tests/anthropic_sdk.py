"""Drives a live `strata serve` with the official `anthropic` Python SDK, unmodified.

Run by router/tests/anthropic_sdk.rs, which starts the server and passes its address. Every check
asserts something a broken server would fail; the first failure exits non-zero with its reason.
"""

import argparse
from typing import Literal

import anthropic
import pydantic
from usage_totals import anthropic_prompt

try:  # the current SDK majors (openai 3.x, anthropic 2.x) bring httpx2, older ones httpx
    import httpx2 as httpx
except ImportError:
    import httpx

# Sampling fields go in the body: the current SDK (2.x) no longer takes `temperature`, `top_p` or
# `top_k` as arguments, and older ones send `extra_body` the same way.
GREEDY = {"temperature": 0}


class Weather(pydantic.BaseModel):
    raining: bool
    sky: Literal["clear", "cloudy", "stormy"]


def check_prompt_caching(client, model: str) -> None:
    """A `cache_control` mark parks the prefix it ends; the usage splits the prompt."""
    document = " ".join(f"Clause {i} says {i * 7 % 13}." for i in range(12))
    marked = [
        {"type": "text", "text": document, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    first_question = [{"role": "user", "content": "Which clause says 5?"}]
    first = client.messages.create(
        model=model, system=marked, messages=first_question, max_tokens=4, extra_body=GREEDY
    )
    total = client.messages.count_tokens(
        model=model, system=marked, messages=first_question
    ).input_tokens
    assert anthropic_prompt(first.usage) == total, (first.usage, total)
    assert first.usage.cache_creation_input_tokens > 0, first.usage
    # Another question after the same marked document reads the document from the cache.
    question = [{"role": "user", "content": "Which clause says 9?"}]
    second = client.messages.create(
        model=model, system=marked, messages=question, max_tokens=4, extra_body=GREEDY
    )
    written = first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= written, (second.usage, first.usage)
    assert second.usage.cache_creation_input_tokens == 0, second.usage
    # The stream's final usage (its last message_delta) carries the split too.
    with client.messages.stream(
        model=model, system=marked, messages=question, max_tokens=4, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert anthropic_prompt(streamed.usage) == anthropic_prompt(second.usage), (streamed.usage, second)
    assert streamed.usage.cache_read_input_tokens >= written, streamed.usage
    # A mark of another kind is refused by name.
    odd = [{"type": "text", "text": document, "cache_control": {"type": "persistent"}}]
    try:
        client.messages.create(model=model, system=odd, messages=question, max_tokens=4)
        raise AssertionError("an unknown cache_control type was accepted")
    except anthropic.BadRequestError as e:
        assert "system.0.cache_control" in str(e), e


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int, required=True)
    # Other names the server gives the model (--served-model-name), and its key (--api-key).
    parser.add_argument("--alias", action="append", default=[])
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = anthropic.Anthropic(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120
    )
    model = args.model
    system = [{"type": "text", "text": "Be brief."}]
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name three prime numbers."}]},
    ]

    # Non-streaming, greedy: one text block, a stop reason, usage.
    greedy = client.messages.create(
        model=model,
        system=system,
        messages=messages,
        max_tokens=24,
        extra_body=GREEDY,
        metadata={"user_id": "test"},
    )
    assert greedy.type == "message" and greedy.role == "assistant", greedy
    assert greedy.id.startswith("msg_"), greedy.id
    assert greedy.model == model, greedy.model
    assert len(greedy.content) == 1 and greedy.content[0].type == "text", greedy.content
    text = greedy.content[0].text
    assert greedy.stop_reason in ("end_turn", "max_tokens"), greedy.stop_reason
    assert greedy.stop_sequence is None, greedy.stop_sequence
    usage = greedy.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0, usage
    if greedy.stop_reason == "max_tokens":
        assert usage.output_tokens == 24, usage

    # count_tokens agrees with the prompt the generation saw: its uncached part plus what was
    # read from and written to the prefix cache.
    counted = client.messages.count_tokens(model=model, system=system, messages=messages)
    assert counted.input_tokens == anthropic_prompt(usage), (counted, usage)
    assert usage.cache_creation_input_tokens == 0, usage

    # Streaming: the text deltas concatenate to the greedy text; the final message agrees.
    with client.messages.stream(
        model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY
    ) as stream:
        event_types = [event.type for event in stream]
        final = stream.get_final_message()
    streamed = "".join(b.text for b in final.content if b.type == "text")
    assert streamed == text, (streamed, text)
    assert final.stop_reason == greedy.stop_reason, (final.stop_reason, greedy.stop_reason)
    assert final.usage.output_tokens == usage.output_tokens, (final.usage, usage)
    assert anthropic_prompt(final.usage) == anthropic_prompt(usage), (final.usage, usage)
    # Asked again, the prompt's whole blocks come from the prefix cache.
    assert final.usage.cache_read_input_tokens > 0, final.usage
    for expected in ("message_start", "content_block_start", "content_block_stop",
                     "message_delta", "message_stop"):
        assert expected in event_types, (expected, event_types)
    with client.messages.stream(
        model=model, system=system, messages=messages, max_tokens=24, extra_body=GREEDY
    ) as stream:
        assert "".join(stream.text_stream) == text

    # A stop sequence taken from the greedy text cuts it there and is reported by name.
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.messages.create(
            model=model,
            system=system,
            messages=messages,
            max_tokens=24,
            extra_body=GREEDY,
            stop_sequences=["never-generated-zz", stop],
        )
        assert cut.stop_reason == "stop_sequence", cut
        assert cut.stop_sequence == stop, (cut.stop_sequence, stop)
        assert cut.content[0].text == text[: text.index(stop)], (cut.content, stop)
        with client.messages.stream(
            model=model, system=system, messages=messages, max_tokens=24,
            extra_body=GREEDY, stop_sequences=[stop],
        ) as stream:
            streamed_cut = "".join(stream.text_stream)
            final_cut = stream.get_final_message()
        assert streamed_cut == cut.content[0].text, (streamed_cut, cut.content)
        assert final_cut.stop_reason == "stop_sequence", final_cut
        assert final_cut.stop_sequence == stop, final_cut

    check_prompt_caching(client, model)

    # Sampled (non-greedy) requests with top_p / top_k work too.
    sampled = client.messages.create(
        model=model, messages=messages, max_tokens=8, extra_body={"top_p": 0.9, "top_k": 20}
    )
    assert sampled.usage.output_tokens > 0, sampled

    # An alias is accepted wherever the model is named; the answer reports the served name.
    for alias in args.alias:
        aliased = client.messages.create(
            model=alias, system=system, messages=messages, max_tokens=4, extra_body=GREEDY
        )
        assert aliased.model == model, (alias, aliased.model)
        assert anthropic_prompt(aliased.usage) == anthropic_prompt(usage), aliased.usage
        aliased_count = client.messages.count_tokens(model=alias, system=system, messages=messages)
        assert aliased_count.input_tokens == counted.input_tokens, aliased_count

    # A server with its own key refuses a client with another (the SDK sends x-api-key).
    if args.api_key != "unused":
        stranger = anthropic.Anthropic(
            base_url=args.base_url, api_key="sk-not-this-one", max_retries=0, timeout=60
        )
        try:
            stranger.messages.create(model=model, messages=messages, max_tokens=4)
            raise AssertionError("a wrong API key was accepted")
        except anthropic.AuthenticationError as e:
            assert e.body["type"] == "error", e.body
            assert e.body["error"]["type"] == "authentication_error", e.body

    # Refusals map to the SDK's exception types, in Anthropic's error shape.
    try:
        client.messages.create(model="no-such-model", messages=messages, max_tokens=4)
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.body["type"] == "error", e.body
        assert e.body["error"]["type"] == "not_found_error", e.body
        assert "no-such-model" in e.body["error"]["message"], e.body
    too_long = "a " * (args.context_window * 2)
    try:
        client.messages.create(
            model=model, messages=[{"role": "user", "content": too_long}], max_tokens=4
        )
        raise AssertionError("a prompt beyond the context window was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
        assert str(args.context_window) in e.body["error"]["message"], e.body

    # Extended thinking is not offered: turning it off is what every request gets, turning it
    # on is refused by name.
    quiet = client.messages.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        thinking={"type": "disabled"},
    )
    assert quiet.stop_reason in ("end_turn", "max_tokens"), quiet
    try:
        client.messages.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2048,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
        raise AssertionError("extended thinking was accepted")
    except anthropic.BadRequestError as e:
        assert "thinking" in e.body["error"]["message"], e.body

    # Structured output as the current SDK sends it (output_config.format from a pydantic
    # model): random weights never write schema-valid JSON by chance, so this needs enforcement.
    parsed = client.messages.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe the weather."}],
        max_tokens=64,
        output_format=Weather,
        extra_body={"temperature": 1.0},
    )
    assert isinstance(parsed.parsed_output, Weather), parsed
    try:
        client.messages.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"output_config": {"format": {"type": "json_schema"}}},
        )
        raise AssertionError("a format without a schema was accepted")
    except anthropic.BadRequestError as e:
        assert "output_config.format" in e.body["error"]["message"], e.body

    # The SDK will not send a request without max_tokens, so raw HTTP checks that refusal.
    raw = httpx.post(
        f"{args.base_url}/v1/messages",
        headers={"anthropic-version": "2023-06-01", "x-api-key": args.api_key},
        json={"model": model, "messages": messages},
        timeout=60,
    )
    assert raw.status_code == 400, raw.text
    body = raw.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    assert "max_tokens" in body["error"]["message"], body
    raw = httpx.post(
        f"{args.base_url}/v1/messages",
        content=b"{not json",
        headers={"content-type": "application/json", "x-api-key": args.api_key},
        timeout=60,
    )
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error", raw.text

    print("anthropic SDK", anthropic.__version__, "ok")


if __name__ == "__main__":
    main()
