"""Drives a live `strata serve` with boto3's bedrock-runtime client, unmodified.

Run by router/tests/converse_boto3.rs, which starts the server and passes its address. boto3
decodes the converse-stream eventstream itself and checks both CRCs of every frame, so a
streamed answer arriving at all proves the framing. Every check asserts something a broken server
would fail; the first failure exits non-zero with its reason.
"""

import argparse
import json
import urllib.error
import urllib.request

import boto3
import botocore
from botocore.config import Config
from botocore.exceptions import ClientError
from usage_totals import converse_prompt


def check_cache_points(client, model: str) -> None:
    """A cachePoint parks the prefix it ends; the usage splits the prompt over the cache."""
    document = " ".join(f"Clause {i} says {i * 7 % 13}." for i in range(12))
    system = [{"text": document}, {"cachePoint": {"type": "default"}}]
    config = {"maxTokens": 4, "temperature": 0}

    def ask(question: str) -> dict:
        messages = [{"role": "user", "content": [{"text": question}]}]
        return client.converse(
            modelId=model, system=system, messages=messages, inferenceConfig=config
        )["usage"]

    first = ask("Which clause says 5?")
    assert first["cacheWriteInputTokens"] > 0, first
    assert first["totalTokens"] == converse_prompt(first) + first["outputTokens"], first
    second = ask("Which clause says 9?")
    assert second["cacheReadInputTokens"] >= first["cacheWriteInputTokens"], (second, first)
    assert second["cacheWriteInputTokens"] == 0, second
    try:
        client.converse(
            modelId=model,
            system=[{"text": document}, {"cachePoint": {"type": "forever"}}],
            messages=[{"role": "user", "content": [{"text": "Hi."}]}],
            inferenceConfig=config,
        )
        raise AssertionError("a cachePoint of an unknown type was accepted")
    except ClientError as e:
        assert e.response["Error"]["Code"] == "ValidationException", e.response
        assert "system.1.cachePoint" in e.response["Error"]["Message"], e.response


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-window", type=int, required=True)
    args = parser.parse_args()
    client = boto3.client(
        "bedrock-runtime",
        endpoint_url=args.base_url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, read_timeout=120),
    )
    model = args.model
    system = [{"text": "Be brief."}]
    messages = [
        {"role": "user", "content": [{"text": "Hello."}]},
        {"role": "assistant", "content": [{"text": "Hi."}]},
        {"role": "user", "content": [{"text": "Name three "}, {"text": "prime numbers."}]},
    ]
    greedy_config = {"maxTokens": 24, "temperature": 0}

    # Non-streaming, greedy: one text block, a stop reason, usage, latency.
    greedy = client.converse(
        modelId=model, system=system, messages=messages, inferenceConfig=greedy_config
    )
    message = greedy["output"]["message"]
    assert message["role"] == "assistant", greedy
    assert len(message["content"]) == 1, message
    text = message["content"][0]["text"]
    assert greedy["stopReason"] in ("end_turn", "max_tokens"), greedy["stopReason"]
    usage = greedy["usage"]
    assert usage["inputTokens"] > 0 and usage["outputTokens"] > 0, usage
    assert usage["totalTokens"] == converse_prompt(usage) + usage["outputTokens"], usage
    if greedy["stopReason"] == "max_tokens":
        assert usage["outputTokens"] == 24, usage
    assert greedy["metrics"]["latencyMs"] >= 0, greedy["metrics"]

    # Streaming: boto3 decodes the frames (CRCs checked); the deltas concatenate to the greedy
    # text, and messageStop / metadata agree with the non-streamed answer.
    response = client.converse_stream(
        modelId=model, system=system, messages=messages, inferenceConfig=greedy_config
    )
    events = list(response["stream"])
    kinds = [next(iter(event)) for event in events]
    assert kinds[0] == "messageStart", kinds
    assert events[0]["messageStart"]["role"] == "assistant", events[0]
    assert kinds[-2:] == ["messageStop", "metadata"], kinds
    assert kinds[-3] == "contentBlockStop", kinds
    streamed = "".join(
        e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e
    )
    assert streamed == text, (streamed, text)
    assert events[-2]["messageStop"]["stopReason"] == greedy["stopReason"], events[-2]
    streamed_usage = events[-1]["metadata"]["usage"]
    # The same prompt again: its whole blocks now come from the prefix cache.
    assert converse_prompt(streamed_usage) == converse_prompt(usage), (streamed_usage, usage)
    assert streamed_usage["outputTokens"] == usage["outputTokens"], (streamed_usage, usage)
    assert streamed_usage["cacheReadInputTokens"] > 0, streamed_usage
    assert events[-1]["metadata"]["metrics"]["latencyMs"] >= 0, events[-1]

    # A stop sequence taken from the greedy text cuts it there.
    if len(text) >= 4:
        stop = text[2:4]
        config = dict(greedy_config, stopSequences=["never-generated-zz", stop])
        cut = client.converse(
            modelId=model, system=system, messages=messages, inferenceConfig=config
        )
        assert cut["stopReason"] == "stop_sequence", cut
        assert cut["output"]["message"]["content"][0]["text"] == text[: text.index(stop)], cut
        events = list(
            client.converse_stream(
                modelId=model, system=system, messages=messages, inferenceConfig=config
            )["stream"]
        )
        streamed_cut = "".join(
            e["contentBlockDelta"]["delta"]["text"] for e in events if "contentBlockDelta" in e
        )
        assert streamed_cut == cut["output"]["message"]["content"][0]["text"], events
        stops = [e["messageStop"]["stopReason"] for e in events if "messageStop" in e]
        assert stops == ["stop_sequence"], events

    check_cache_points(client, model)

    # Sampled requests with topP work too.
    sampled = client.converse(
        modelId=model, messages=messages, inferenceConfig={"maxTokens": 8, "topP": 0.9}
    )
    assert sampled["usage"]["outputTokens"] > 0, sampled

    # additionalModelRequestFields: top_k = 1 keeps only the likeliest token, so sampling at
    # temperature 1 gives the greedy text; requestMetadata and standard latency are accepted.
    top1 = client.converse(
        modelId=model,
        system=system,
        messages=messages,
        inferenceConfig={"maxTokens": 24, "temperature": 1.0},
        additionalModelRequestFields={"top_k": 1},
        requestMetadata={"team": "tests"},
        performanceConfig={"latency": "standard"},
    )
    assert top1["output"]["message"]["content"][0]["text"] == text, (top1, text)

    # Refusals reach botocore as ClientError with Converse's error codes.
    def refused(code: str, **kwargs) -> str:
        try:
            client.converse(**kwargs)
        except ClientError as e:
            error = e.response["Error"]
            assert error["Code"] == code, e.response
            return error["Message"]
        raise AssertionError(f"expected {code}: {kwargs}")

    message = refused("ResourceNotFoundException", modelId="no-such-model", messages=messages)
    assert "no-such-model" in message, message
    too_long = "a " * (args.context_window * 2)
    message = refused(
        "ValidationException",
        modelId=model,
        messages=[{"role": "user", "content": [{"text": too_long}]}],
        inferenceConfig={"maxTokens": 4},
    )
    assert str(args.context_window) in message, message
    message = refused(
        "ValidationException",
        modelId=model,
        messages=[
            {"role": "user", "content": [{"text": "look"}, {"image": {
                "format": "png", "source": {"bytes": b"\x89PNG"}}}]},
        ],
    )
    assert "messages.0.content.1" in message, message
    try:
        client.converse_stream(modelId="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted for streaming")
    except ClientError as e:
        assert e.response["Error"]["Code"] == "ResourceNotFoundException", e.response

    # Raw HTTP: malformed JSON is a ValidationException in Converse's shape (header + message).
    request = urllib.request.Request(
        f"{args.base_url}/model/{model}/converse",
        data=b"{not json",
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("malformed JSON was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        assert e.headers["x-amzn-errortype"] == "ValidationException", dict(e.headers)
        assert "message" in json.loads(e.read()), "no message"

    print("boto3", boto3.__version__, "botocore", botocore.__version__, "ok")


if __name__ == "__main__":
    main()
