"""Structured output, forced tool calls, logprobs, n and sampling extensions through the official
`openai` Python SDK, unmodified, against a random-weight model (run by openai_structured.rs).

Each check asserts something a server without enforcement would fail: random weights never
write schema-valid JSON or a well-formed tool call by chance within these token budgets.
"""

import argparse
import json
from typing import Literal

import openai
import pydantic

QUESTION = [{"role": "user", "content": "Describe the weather."}]


class Weather(pydantic.BaseModel):
    raining: bool
    unit: Literal["c", "f"]
    sky: Literal["clear", "cloudy", "stormy"]


UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "get_temperature",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}, "indoors": {"type": "boolean"}},
            "required": ["unit", "indoors"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "local"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def structured(client: openai.OpenAI, model: str) -> None:
    # The SDK's own structured-output helper: a strict json_schema from a pydantic model,
    # parsed back into it.
    for seed in range(3):
        parsed = client.chat.completions.parse(
            model=model,
            messages=QUESTION,
            response_format=Weather,
            max_tokens=64,
            temperature=1.0,
            seed=seed,
        )
        choice = parsed.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Weather), choice.message
    # Canary: the same request without the schema is not JSON.
    free = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=64, temperature=1.0, seed=0
    )
    try:
        json.loads(free.choices[0].message.content)
        raise AssertionError(f"free text parsed as JSON: {free.choices[0].message.content!r}")
    except json.JSONDecodeError:
        pass

    # json_object, streamed: the concatenated deltas are one JSON object (the budget may end
    # it early, so only a complete stop is parsed).
    chunks = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        response_format={"type": "json_object"},
        max_tokens=48,
        temperature=0,
        stream=True,
    )
    text, finish = "", None
    for chunk in chunks:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text.startswith("{"), text
    if finish == "stop":
        assert isinstance(json.loads(text), dict), text

    for bad in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}},
        {"type": "yaml"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
    ):
        try:
            client.chat.completions.create(
                model=model, messages=QUESTION, response_format=bad, max_tokens=4
            )
            raise AssertionError(f"response_format {bad!r} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400, e


def vllm_fields(client: openai.OpenAI, model: str) -> None:
    # vLLM's structured-output fields, sent as vLLM clients send them (extra_body).
    choices = ["alpha", "beta gamma"]
    for seed in range(3):
        for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            out = client.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=seed,
                extra_body=body,
            )
            assert out.choices[0].message.content in choices, (body, out.choices[0])
    regex = r"[0-9]{3}-[a-z]{2}"
    out = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=1,
        extra_body={"guided_regex": regex},
    )
    import re
    assert re.fullmatch(regex, out.choices[0].message.content), out.choices[0]
    schema = Weather.model_json_schema()
    out = client.completions.create(
        model=model, prompt="Weather:", max_tokens=64, temperature=1.0, seed=2,
        extra_body={"guided_json": schema},
    )
    if out.choices[0].finish_reason == "stop":
        Weather.model_validate_json(out.choices[0].text)
    else:
        assert out.choices[0].text.startswith("{"), out.choices[0]
    # Two sources at once, or a malformed one, are refused by name.
    for body, param in (
        ({"guided_choice": choices, "guided_regex": regex}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
        ({"guided_json": "not json"}, "guided_json"),
    ):
        try:
            client.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=4, extra_body=body
            )
            raise AssertionError(f"{body!r} was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body.get("param") == param, (body, e.body)


def responses_format(client: openai.OpenAI, model: str) -> None:
    # What the SDK's responses.parse sends: text.format with a strict json_schema.
    parsed = client.responses.parse(
        model=model, input="Describe the weather.", text_format=Weather,
        max_output_tokens=64, temperature=1.0,
    )
    assert isinstance(parsed.output_parsed, Weather), parsed
    assert parsed.text.format.type == "json_schema", parsed.text
    try:
        client.responses.create(
            model=model, input="hi", max_output_tokens=4,
            text={"format": {"type": "json_schema", "name": "x"}},
        )
        raise AssertionError("a json_schema format without a schema was accepted")
    except openai.BadRequestError as e:
        assert e.body.get("param") == "text.format", e.body


def forced_calls(client: openai.OpenAI, model: str) -> None:
    tools = [UNIT_TOOL, TIME_TOOL]
    named = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        temperature=1.0,
        seed=3,
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time", call
    assert json.loads(call.function.arguments)["zone"] in ("utc", "local"), call

    # Each choice's calls have ids of their own.
    two = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        temperature=1.0,
        seed=3,
        n=2,
    )
    ids = [c.id for choice in two.choices for c in choice.message.tool_calls or []]
    assert len(ids) == 2 and len(set(ids)) == 2, ids

    required = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=tools,
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=5,
        stream=True,
    )
    calls, finish = {}, None
    for chunk in required:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                slot = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                if delta.function and delta.function.name:
                    slot["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    slot["arguments"] += delta.function.arguments
            finish = c.finish_reason or finish
    # The grammar lets calls follow calls; when the limit cuts the last one off, the answer ends
    # as `length` and carries only the complete calls (never a partial one).
    assert finish in ("tool_calls", "length") and calls, (finish, calls)
    for slot in calls.values():
        json.loads(slot["arguments"])
    for slot in calls.values():
        assert slot["name"] in ("get_temperature", "get_time"), slot
        assert isinstance(json.loads(slot["arguments"]), dict), slot

    try:
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=tools,
            tool_choice="required",
            response_format={"type": "json_object"},
            max_tokens=4,
        )
        raise AssertionError("a forced call with response_format was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "response_format", e.body


def spells(tokens: list[str], text: str) -> bool:
    """The text is the tokens in order, except special tokens, which the text leaves out."""
    at = 0
    for token in tokens:
        if text.startswith(token, at):
            at += len(token)
    return at == len(text)


def logprobs(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens, (len(content), chat.usage)
    assert spells([t.token for t in content], chat.choices[0].message.content), content
    for t in content:
        assert len(t.top_logprobs) == 3, t
        # Greedy: the chosen token is the most likely.
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob, t
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token, t

    streamed = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        stream=True,
    )
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in tokens] == [t.logprob for t in content], (tokens, content)

    legacy = client.completions.create(model=model, prompt="The sky", max_tokens=5, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5, lp
    assert spells(lp.tokens, legacy.choices[0].text), lp
    assert all(len(top) <= 2 for top in lp.top_logprobs), lp
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp
    # Streamed, the offsets go on from chunk to chunk: the same as the whole answer's.
    chunks = client.completions.create(
        model=model, prompt="The sky", max_tokens=5, temperature=0, logprobs=2, stream=True
    )
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset, (offsets, lp.text_offset)

    for extra in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        try:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, **extra)
            raise AssertionError(f"{extra} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] in ("top_logprobs", "logprobs"), e.body


def choices(client: openai.OpenAI, model: str) -> None:
    many = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in many.choices] == [0, 1, 2], many
    assert many.usage.completion_tokens == sum(8 for _ in many.choices), many.usage
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) > 1, texts
    # Choice i samples with seed + i: choice 1 equals a single request seeded one higher.
    single = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=1.0, seed=12
    )
    assert single.choices[0].message.content == texts[1], (single, texts)

    streamed = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    by_index, finishes, usage = {}, {}, None
    for chunk in streamed:
        usage = chunk.usage or usage
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [by_index[i] for i in range(3)] == texts, (by_index, texts)
    assert finishes == {0: "length", 1: "length", 2: "length"}, finishes
    assert usage.completion_tokens == 24, usage

    # Extensions: top_k=1 is greedy whatever the temperature; min_p is accepted.
    greedy = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    top1 = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_tokens=8,
        temperature=1.5,
        seed=2,
        extra_body={"top_k": 1, "min_p": 0.1},
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content, (top1, greedy)
    try:
        client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=2, extra_body={"top_k": -5}
        )
        raise AssertionError("top_k=-5 was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "top_k", e.body


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
    structured(client, args.model)
    vllm_fields(client, args.model)
    responses_format(client, args.model)
    forced_calls(client, args.model)
    logprobs(client, args.model)
    choices(client, args.model)
    print("openai SDK", openai.__version__, "structured output, tools, logprobs, n ok")


if __name__ == "__main__":
    main()
