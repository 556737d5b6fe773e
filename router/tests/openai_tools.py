"""Tool calling through the official `openai` Python SDK, unmodified.

Run twice by router/tests/openai_tools.rs: with --base-url against a live server (the request
path), and with --framed, a directory of fixed outputs framed by the handler's own code. Every check asserts something a broken server would fail;
the first failure exits non-zero with its reason.
"""

import argparse
import json
import pathlib

import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {}}}]


def request_path(client: openai.OpenAI, model: str) -> None:
    """Tools reach the template (the prompt grows by the template's tool instructions) for
    every `tool_choice` that renders them, and the request is served."""
    question = [{"role": "user", "content": "Hi"}]
    plain = client.chat.completions.create(model=model, messages=question, max_tokens=1, seed=1)
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "w"}}):
        extra = {} if choice is None else {"tool_choice": choice}
        served = client.chat.completions.create(
            model=model, messages=question, tools=TOOLS, max_tokens=1, seed=1, **extra
        )
        assert served.usage.prompt_tokens > plain.usage.prompt_tokens + 50, (choice, served.usage)
        assert served.choices[0].finish_reason in ("stop", "length", "tool_calls"), served

    # A pydantic tool with a nested model ($defs + $ref), forced: its references resolve against
    # its own schema, so the forced grammar compiles and the request is served (it was a 400
    # "Pointer '/$defs/…' does not exist"); a forced call parses back to the nested model.
    import pydantic

    class Place(pydantic.BaseModel):
        city: str

    class Book(pydantic.BaseModel):
        to: Place

    book = openai.pydantic_function_tool(Book)
    assert "$defs" in json.dumps(book["function"]["parameters"]), book
    for choice in ("required", {"type": "function", "function": {"name": "Book"}}):
        forced = client.chat.completions.create(
            model=model, messages=question, tools=[book], tool_choice=choice, max_tokens=64, seed=1
        )
        calls = forced.choices[0].message.tool_calls or []
        assert forced.choices[0].finish_reason in ("tool_calls", "length"), forced
        for call in calls:
            Book.model_validate_json(call.function.arguments)

    # "none" renders no tools (and parses no calls): the plain prompt.
    none = client.chat.completions.create(
        model=model, messages=question, tools=TOOLS, tool_choice="none", max_tokens=4, seed=1
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens, (none.usage, plain.usage)
    assert none.choices[0].message.tool_calls is None, none

    # A tool conversation: the assistant's call and the tool's answer reach the template.
    conversation = question + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "w", "arguments": json.dumps({"c": "P"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18"},
    ]
    done = client.chat.completions.create(model=model, messages=conversation, max_tokens=8, seed=1)
    assert done.choices[0].finish_reason in ("stop", "length"), done
    assert done.usage.prompt_tokens > plain.usage.prompt_tokens + 10, (done.usage, plain.usage)
    streamed = client.chat.completions.create(
        model=model, messages=conversation, max_tokens=8, seed=1, stream=True
    )
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices]
    assert finishes[-1] in ("stop", "length"), finishes

    for bad, param in (
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ("sometimes", "tool_choice"),
        ([{"type": "retrieval"}], "tools[0]"),
    ):
        tools, choice = (bad, "auto") if param.startswith("tools") else (TOOLS, bad)
        try:
            client.chat.completions.create(
                model=model, messages=question, tools=tools, tool_choice=choice, max_tokens=4
            )
            raise AssertionError(f"{param}={bad!r} was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == param, e.body
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"tools": TOOLS})
        raise AssertionError("tools accepted on /v1/completions")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tools", e.body


def streamed_calls(chunks: list) -> tuple[str, dict, str]:
    """Reassembles streamed content and tool calls the way SDK users do."""
    content, calls, finish = "", {}, None
    for raw in chunks:
        chunk = ChatCompletionChunk.model_validate(raw)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    slot["id"] = call.id
                if call.function and call.function.name:
                    slot["name"] = call.function.name
                if call.function and call.function.arguments:
                    slot["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return content, calls, finish


def framing(directory: pathlib.Path) -> None:
    def load(name: str) -> tuple[ChatCompletion, tuple[str, dict, str]]:
        framed = json.loads((directory / f"{name}.json").read_text())
        return ChatCompletion.model_validate(framed["whole"]), streamed_calls(framed["chunks"])

    whole, (content, calls, finish) = load("hermes_two_calls")
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls", whole
    assert message.content == "Checking.", message
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"], message
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}, message
    assert len({c.id for c in message.tool_calls}) == 2, message
    assert finish == "tool_calls" and content == "Checking.\n", (finish, content)
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"], calls
    assert [calls[i]["id"] for i in sorted(calls)] == [c.id for c in message.tool_calls], calls
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}, calls

    whole, (content, calls, finish) = load("hermes_malformed")
    assert whole.choices[0].message.tool_calls is None, whole
    assert whole.choices[0].finish_reason == "stop", whole
    assert content == whole.choices[0].message.content and not calls and finish == "stop"

    whole, (content, calls, finish) = load("llama_json")
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and whole.choices[0].message.content is None
    assert json.loads(call.function.arguments) == {"city": "Oslo"}, call
    assert content == "" and calls[0]["name"] == "get_weather" and finish == "tool_calls"

    whole, (content, calls, finish) = load("no_tools")
    assert whole.choices[0].message.content == "<tool_call>{}</tool_call>", whole
    assert content == "<tool_call>{}</tool_call>" and not calls and finish == "stop"


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
        client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=120)
        request_path(client, args.model)
    print("openai SDK", openai.__version__, "tools ok")


if __name__ == "__main__":
    main()
