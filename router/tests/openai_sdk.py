"""Drives a live `strata serve` with the official `openai` Python SDK, unmodified.

Run by router/tests/openai_sdk.rs, which starts the server and passes its address. Every check
asserts something a broken server would fail; the first failure exits non-zero with its reason.
"""

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int, required=True)
    # Other names the server gives the model (--served-model-name), and its key (--api-key).
    parser.add_argument("--alias", action="append", default=[])
    parser.add_argument("--api-key", default="unused")
    args = parser.parse_args()
    client = openai.OpenAI(
        base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120
    )
    model = args.model
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name three prime numbers."}]},
    ]

    # models.list names the served model.
    ids = [m.id for m in client.models.list()]
    assert model in ids, f"{model} not in {ids}"
    assert client.models.retrieve(model).id == model

    # Non-streaming chat: one choice, a finish reason, consistent usage.
    greedy = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0, seed=1, user="test"
    )
    assert greedy.object == "chat.completion", greedy
    assert greedy.id.startswith("chatcmpl-"), greedy.id
    assert len(greedy.choices) == 1, greedy
    choice = greedy.choices[0]
    assert choice.finish_reason in ("stop", "length"), choice
    assert choice.message.role == "assistant"
    usage = greedy.usage
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 24, usage

    # Streaming chat: the deltas concatenate to the greedy non-streaming text, and
    # include_usage brings a final chunk with usage and no choices.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage_chunks = [], None, []
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            assert chunk.choices == [], chunk
            usage_chunks.append(chunk.usage)
            continue
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason is not None:
                finish = c.finish_reason
    streamed = "".join(pieces)
    assert streamed == choice.message.content, (streamed, choice.message.content)
    assert finish == choice.finish_reason, (finish, choice.finish_reason)
    assert len(usage_chunks) == 1, usage_chunks
    assert usage_chunks[0].completion_tokens == usage.completion_tokens, usage_chunks

    # A stop string cuts the text before it (taken from the greedy text, so it must occur).
    text = choice.message.content
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stop=[stop]
        )
        assert cut.choices[0].finish_reason == "stop", cut
        assert cut.choices[0].message.content == text[: text.index(stop)], (cut, stop)

    # Completions, plain and streamed.
    completion = client.completions.create(
        model=model, prompt="Hello, strata", max_tokens=16, temperature=0
    )
    assert completion.object == "text_completion", completion
    assert completion.choices[0].finish_reason in ("stop", "length"), completion
    assert completion.usage.completion_tokens > 0, completion.usage
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Hello, strata", max_tokens=16, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == completion.choices[0].text, (streamed, completion.choices[0].text)

    # A batch of prompts: one choice per prompt, in order, each what the prompt gives alone;
    # every prompt counts in the usage. Token-id prompts batch too.
    prompts = ["Hello, strata", "A second prompt", "Hello, strata"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=16, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2], batch
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0)
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone], batch
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), batch.usage
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = {}
    for c in client.completions.create(
        model=model, prompt=prompts, max_tokens=16, temperature=0, stream=True
    ):
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in batch.choices], streamed
    ids = client.completions.create(
        model=model, prompt=[[11, 12, 13], [14, 15]], max_tokens=4, temperature=0
    )
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5, ids

    # echo: the prompt's text, then the completion, whole and streamed.
    echoed = client.completions.create(
        model=model, prompt="Hello, strata", max_tokens=16, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "Hello, strata" + completion.choices[0].text, echoed
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt="Hello, strata", max_tokens=16, temperature=0, stream=True, echo=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text, streamed
    try:
        client.completions.create(
            model=model, prompt="Hello", max_tokens=4, echo=True, logprobs=2
        )
        raise AssertionError("echo with logprobs was accepted")
    except openai.BadRequestError as e:
        assert "echo" in str(e), e

    # An alias is accepted wherever the model is named; answers report the served name; every
    # name is listed (as vLLM lists --served-model-name) and retrieved as itself.
    listed = [m.id for m in client.models.list()]
    assert listed == [model] + args.alias, listed
    for alias in args.alias:
        aliased = client.chat.completions.create(
            model=alias, messages=messages, max_tokens=4, temperature=0
        )
        assert aliased.model == model, (alias, aliased.model)
        assert aliased.usage.prompt_tokens == usage.prompt_tokens, aliased.usage
        aliased = client.completions.create(model=alias, prompt="Hello", max_tokens=2)
        assert aliased.model == model, (alias, aliased.model)
        retrieved = client.models.retrieve(alias)
        assert retrieved.id == alias and retrieved.model_extra["root"] == model, retrieved

    # A server with its own key refuses a client with another (the SDK sends it as Bearer).
    if args.api_key != "unused":
        stranger = openai.OpenAI(
            base_url=args.base_url, api_key="sk-not-this-one", max_retries=0, timeout=60
        )
        try:
            stranger.models.list()
            raise AssertionError("a wrong API key was accepted")
        except openai.AuthenticationError as e:
            assert e.code == "invalid_api_key", e.body

    # Refusals map to the SDK's exception types.
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e
    try:
        client.chat.completions.create(model=model, messages=messages, n=33)
        raise AssertionError("n=33 was accepted")
    except openai.BadRequestError as e:
        assert "n" == e.body.get("param"), e.body
    too_long = "a " * (args.context_window * 2)
    try:
        client.completions.create(model=model, prompt=too_long, max_tokens=4)
        raise AssertionError("a prompt beyond the context window was accepted")
    except openai.BadRequestError as e:
        assert str(args.context_window) in e.message, e.message
        assert "tokens" in e.message, e.message

    print("openai SDK", openai.__version__, "ok")


if __name__ == "__main__":
    main()
