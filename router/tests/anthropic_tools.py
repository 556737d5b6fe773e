"""Tool calling through the official `anthropic` Python SDK, unmodified.

Run twice by router/tests/anthropic_tools.rs: with --base-url against a live server (the request
path), and with --framed, a directory of fixed outputs framed by the handler's own code, which
the SDK's client and stream helpers parse through an in-memory HTTP transport. Every check
asserts something a broken server would fail; the first failure exits non-zero with its reason.
"""

import argparse
import json
import pathlib

import anthropic
from usage_totals import anthropic_prompt

try:  # the current SDK majors (openai 3.x, anthropic 2.x) bring httpx2 and take only its
    # clients; older ones httpx
    import httpx2 as httpx
except ImportError:
    import httpx

# Sampling fields go in the body: the current SDK no longer takes `temperature` as an argument.
GREEDY = {"temperature": 0}

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def conversation(result: str, city: str = "Paris") -> list:
    """A finished tool round: the assistant's call and the tool's result."""
    return QUESTION + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": city}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": result}]},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]


def shape(content: list) -> list:
    """Blocks as comparable tuples (a streamed block also carries the SDK's private JSON buffer)."""
    return [
        ("text", b.text) if b.type == "text" else (b.type, b.id, b.name, b.input) for b in content
    ]


def request_path(client: anthropic.Anthropic, model: str) -> None:
    plain = client.messages.count_tokens(model=model, messages=QUESTION).input_tokens

    # Tools reach the template (the prompt grows by its tool instructions) for every choice that
    # renders them; count_tokens renders the same prompt; the answer's blocks are well formed.
    for choice in (None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}):
        extra = {} if choice is None else {"tool_choice": choice}
        served = client.messages.create(
            model=model, messages=QUESTION, tools=[WEATHER], max_tokens=4, extra_body=GREEDY, **extra
        )
        assert anthropic_prompt(served.usage) > plain + 50, (choice, served.usage, plain)
        counted = client.messages.count_tokens(
            model=model, messages=QUESTION, tools=[WEATHER], **extra
        )
        assert counted.input_tokens == anthropic_prompt(served.usage), (choice, counted, served.usage)
        assert served.stop_reason in ("end_turn", "max_tokens", "tool_use"), served
        assert served.content and served.content[0].type in ("text", "tool_use"), served
        with client.messages.stream(
            model=model, messages=QUESTION, tools=[WEATHER], max_tokens=4, extra_body=GREEDY, **extra
        ) as stream:
            final = stream.get_final_message()
        assert shape(final.content) == shape(served.content), (final.content, served.content)
        assert final.stop_reason == served.stop_reason, (final, served)

    # A forced call is enforced while decoding: a random-weight model answers with exactly one
    # well-formed tool_use block of the named tool, streamed and not.
    unit = {
        "name": "get_unit",
        "input_schema": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    }
    for seed_temperature in (0, 1.0):
        forced = dict(
            model=model, messages=QUESTION, tools=[WEATHER, unit],
            tool_choice={"type": "tool", "name": "get_unit"}, max_tokens=64,
            extra_body={"temperature": seed_temperature},
        )
        served = client.messages.create(**forced)
        assert served.stop_reason == "tool_use", served
        calls = [b for b in served.content if b.type == "tool_use"]
        assert len(calls) == 1 and calls[0].name == "get_unit", served
        assert calls[0].input["unit"] in ("c", "f"), calls
        if seed_temperature == 0:
            with client.messages.stream(**forced) as stream:
                final = stream.get_final_message()
            # Ids differ per response; the call itself is the same.
            same = [(b.name, b.input) for b in final.content]
            assert same == [(b.name, b.input) for b in served.content], (final, served)

    # "none" renders no tools: the plain prompt.
    none = client.messages.create(
        model=model, messages=QUESTION, tools=[WEATHER], tool_choice={"type": "none"},
        max_tokens=4, extra_body=GREEDY,
    )
    assert anthropic_prompt(none.usage) == plain, (none.usage, plain)
    assert [b.type for b in none.content] == ["text"], none

    # A tool round reaches the template: the synthesized tokenizer is byte-level, so the prompt
    # grows by exactly the bytes added to the tool's result or to the call's input.
    def count(messages: list) -> int:
        return client.messages.count_tokens(
            model=model, messages=messages, tools=[WEATHER]
        ).input_tokens

    short = count(conversation("18"))
    assert count(conversation("18 and sunny")) == short + len(" and sunny"), short
    assert count(conversation("18", city="Parisian")) == short + len("ian"), short
    done = client.messages.create(
        model=model, messages=conversation("18"), tools=[WEATHER], max_tokens=8, extra_body=GREEDY
    )
    assert anthropic_prompt(done.usage) == short, (done.usage, short)
    assert done.stop_reason in ("end_turn", "max_tokens", "tool_use"), done
    errored = conversation("timed out")
    errored[-1]["content"][0]["is_error"] = True
    with client.messages.stream(
        model=model, messages=errored, tools=[WEATHER], max_tokens=8, extra_body=GREEDY
    ) as stream:
        assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens", "tool_use")

    # Bad definitions and misplaced blocks are 400s in Anthropic's shape.
    refusals = [
        ({"tools": [{"input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools.0.input_schema"),
        ({"tools": [WEATHER, WEATHER]}, "tools: tool names must be unique"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"messages": QUESTION + [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}]},
         "messages.1.content.0"),
    ]
    for fields, expected in refusals:
        request = {"model": model, "messages": QUESTION, "max_tokens": 4, **fields}
        try:
            client.messages.create(**request)
            raise AssertionError(f"accepted: {fields}")
        except anthropic.BadRequestError as e:
            assert e.body["type"] == "error", e.body
            assert e.body["error"]["type"] == "invalid_request_error", e.body
            assert e.body["error"]["message"].startswith(expected), (expected, e.body)
    try:
        client.messages.count_tokens(model=model, messages=QUESTION, tools=[WEATHER, WEATHER])
        raise AssertionError("count_tokens accepted duplicate tools")
    except anthropic.BadRequestError as e:
        assert "unique" in e.body["error"]["message"], e.body


def offline_client(framed: dict) -> anthropic.Anthropic:
    """A client whose transport answers with the framed response: the whole message, or the
    events as an SSE body when the request streams."""

    def answer(request):
        if json.loads(request.content).get("stream"):
            body = "".join(
                f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in framed["events"]
            )
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, text=body
            )
        return httpx.Response(200, json=framed["whole"])

    return anthropic.Anthropic(
        base_url="http://offline", api_key="unused", max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(answer)),
    )


def framing(directory: pathlib.Path) -> None:
    def load(name: str):
        """The SDK's parse of the whole message, and of the stream by its helpers."""
        client = offline_client(json.loads((directory / f"{name}.json").read_text()))
        request = {"model": "offline", "messages": QUESTION, "max_tokens": 8, "tools": [WEATHER]}
        whole = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_message()
        return whole, events, final

    whole, events, final = load("hermes_two_calls")
    assert whole.stop_reason == "tool_use", whole
    assert [b.type for b in whole.content] == ["text", "tool_use", "tool_use"], whole.content
    assert whole.content[0].text == "Checking.\n", whole.content
    weather, time = whole.content[1], whole.content[2]
    assert (weather.name, weather.input) == ("get_weather", {"city": "Paris"}), weather
    assert (time.name, time.input) == ("get_time", {}), time
    assert weather.id.startswith("toolu_") and weather.id != time.id, (weather, time)
    # The stream helpers accumulate the input_json deltas into the same message.
    assert shape(final.content) == shape(whole.content), (final.content, whole.content)
    assert final.stop_reason == "tool_use", final
    inputs = [e for e in events if e.type == "input_json"]
    assert [e.snapshot for e in inputs] == [{"city": "Paris"}, {}], inputs
    assert json.loads(inputs[0].partial_json) == {"city": "Paris"}, inputs
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use", "tool_use"], starts
    assert starts[1].input == {} and starts[1].id == weather.id, starts
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert stops == [0, 1, 2], stops

    whole, events, final = load("hermes_malformed")
    assert [b.type for b in whole.content] == ["text"], whole.content
    assert whole.content[0].text == '<tool_call>{"name": oops}</tool_call>', whole.content
    assert whole.stop_reason == "max_tokens" and final.stop_reason == "max_tokens", whole
    assert shape(final.content) == shape(whole.content), (final.content, whole.content)

    whole, events, final = load("llama_json")
    assert [b.type for b in whole.content] == ["tool_use"], whole.content
    assert whole.content[0].input == {"city": "Oslo"}, whole.content
    assert shape(final.content) == shape(whole.content) and final.stop_reason == "tool_use", final

    # Cut by the token limit after a complete call: the call stays, the stop is max_tokens.
    whole, events, final = load("call_then_text")
    assert [b.type for b in whole.content] == ["tool_use", "text"], whole.content
    assert whole.content[1].text == "\nDone.", whole.content
    assert whole.stop_reason == "max_tokens", whole
    assert shape(final.content) == shape(whole.content) and final.stop_reason == "max_tokens", final

    # A call the limit cut off: no tool_use block, none of its markup in the text, max_tokens.
    whole, events, final = load("hermes_cut_call")
    assert [b.type for b in whole.content] == ["text"], whole.content
    assert whole.content[0].text == "Let me check.", whole.content
    assert whole.stop_reason == "max_tokens" and final.stop_reason == "max_tokens", whole
    assert shape(final.content) == shape(whole.content), (final.content, whole.content)
    assert "".join(e.text for e in events if e.type == "text") == "Let me check.", events

    whole, events, final = load("no_tools")
    assert [b.type for b in whole.content] == ["text"], whole.content
    assert whole.content[0].text == "<tool_call>{}</tool_call>", whole.content
    assert whole.stop_reason == "end_turn", whole
    assert shape(final.content) == shape(whole.content), final
    assert "".join(e.text for e in events if e.type == "text") == whole.content[0].text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url")
    parser.add_argument("--model")
    parser.add_argument("--context-window", type=int)
    parser.add_argument("--framed", type=pathlib.Path)
    args = parser.parse_args()
    if args.framed:
        framing(args.framed)
    else:
        client = anthropic.Anthropic(
            base_url=args.base_url, api_key="unused", max_retries=0, timeout=120
        )
        request_path(client, args.model)
    print("anthropic SDK", anthropic.__version__, "tools ok")


if __name__ == "__main__":
    main()
