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

    function_tools(client, model)
    print("openai SDK", openai.__version__, "responses ok")


# A function whose only argument is an enum: a forced call of it is short and fully determined
# but for the value, so a random-weight model always completes it within the limit.
UNIT = {
    "type": "function",
    "name": "get_unit",
    "description": "The temperature unit to answer in.",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": False,
}


def function_calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def function_tools(client: openai.OpenAI, model: str) -> None:
    """Function tools: rendered, a forced call parsed into `function_call` items (whole and
    streamed), the call's result sent back, and refusals naming the field."""
    question = "Which unit?"
    plain = client.responses.create(model=model, input=question, max_output_tokens=4, temperature=0)

    for tools, choice in (([UNIT], "required"), ([WEATHER, UNIT], {"type": "function", "name": "get_unit"})):
        forced = dict(
            model=model, input=question, tools=tools, tool_choice=choice,
            max_output_tokens=128, temperature=0,
        )
        called = client.responses.create(**forced)
        # The canary: without calls parsed from the output this list is empty.
        calls = function_calls(called)
        assert len(calls) == 1, called.output
        call = calls[0]
        assert call.name == "get_unit" and call.status == "completed", call
        assert json.loads(call.arguments)["unit"] in ("c", "f"), call
        assert call.call_id.startswith("call_") and call.id.startswith("fc_"), call
        assert called.status == "completed", called
        assert [t.name for t in called.tools] == [t["name"] for t in tools], called.tools
        assert called.usage.input_tokens > plain.usage.input_tokens + 20, (called.usage, plain.usage)
        if isinstance(choice, str):
            assert called.tool_choice == choice, called.tool_choice
        else:
            assert called.tool_choice.name == "get_unit", called.tool_choice

        # Streamed: the raw events, and the SDK's own accumulation of them.
        kinds, final = [], None
        for event in client.responses.create(stream=True, **forced):
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.done":
                assert json.loads(event.arguments) == json.loads(call.arguments), event
            final = event.response if event.type == "response.completed" else final
        assert final is not None, kinds
        for kind in (
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ):
            assert kind in kinds, (kind, kinds)
        same = [(c.name, c.arguments) for c in function_calls(final)]
        assert same == [(call.name, call.arguments)], (final.output, called.output)
        with client.responses.stream(**forced) as stream:
            accumulated = stream.get_final_response()
        assert [(c.name, c.arguments) for c in function_calls(accumulated)] == same, accumulated

    # The call's result sent back after previous_response_id: the stored conversation holds the
    # call, so the prompt equals the one built from the same items sent afresh.
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "c"}
    follow = client.responses.create(
        model=model, previous_response_id=called.id, input=[answer], tools=tools,
        max_output_tokens=8, temperature=0,
    )
    assert follow.status in ("completed", "incomplete"), follow
    assert follow.usage.input_tokens > called.usage.input_tokens, (follow.usage, called.usage)
    echoed = [item.model_dump(exclude_none=True) for item in called.output]
    fresh = client.responses.create(
        model=model, input=[{"role": "user", "content": question}, *echoed, answer],
        tools=tools, max_output_tokens=8, temperature=0,
    )
    assert fresh.usage.input_tokens == follow.usage.input_tokens, (fresh.usage, follow.usage)
    assert fresh.output_text == follow.output_text, (fresh.output, follow.output)

    # "none" renders no tools: the plain prompt, and only a message.
    none = client.responses.create(
        model=model, input=question, tools=[UNIT], tool_choice="none", max_output_tokens=4,
        temperature=0,
    )
    assert none.usage.input_tokens == plain.usage.input_tokens, (none.usage, plain.usage)
    assert [item.type for item in none.output] == ["message"], none.output

    for kwargs, param in (
        (dict(tools=[UNIT, {"type": "web_search"}]), "tools[1].type"),
        (dict(tools=[UNIT], tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
    ):
        try:
            client.responses.create(model=model, input=question, max_output_tokens=4, **kwargs)
            raise AssertionError(f"{kwargs} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, (kwargs, e.body)
            assert param in e.body["message"], e.body


if __name__ == "__main__":
    main()
