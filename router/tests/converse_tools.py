"""Tool calling through boto3's bedrock-runtime client, unmodified.

Run twice by router/tests/converse_tools.rs: with --base-url against a live server (the request
path), and with --framed, a directory of fixed outputs framed by the handlers' own code, served
to boto3 by a local HTTP server that answers with those recorded bodies (boto3 decodes the
eventstream and checks both CRCs of every frame). Every check asserts something a broken server
would fail; the first failure exits non-zero with its reason.
"""

import argparse
import http.server
import json
import pathlib
import threading
import urllib.error
import urllib.request

import boto3
import botocore
from botocore.config import Config
from botocore.exceptions import ClientError
from usage_totals import converse_prompt

WEATHER = {
    "toolSpec": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "inputSchema": {
            "json": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            }
        },
    }
}
TOOLS = {"tools": [WEATHER]}
QUESTION = [{"role": "user", "content": [{"text": "Weather in Paris?"}]}]
GREEDY = {"maxTokens": 4, "temperature": 0}


def client_for(base_url: str):
    return boto3.client(
        "bedrock-runtime",
        endpoint_url=base_url,
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=Config(retries={"max_attempts": 1}, read_timeout=120),
    )


def conversation(result: str, city: str = "Paris") -> list:
    """A finished tool round: the assistant's call and the tool's result."""
    return QUESTION + [
        {
            "role": "assistant",
            "content": [
                {"text": "Checking."},
                {"toolUse": {"toolUseId": "tooluse_1", "name": "get_weather",
                             "input": {"city": city}}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"toolResult": {"toolUseId": "tooluse_1", "content": [{"text": result}]}},
                {"text": "Thanks."},
            ],
        },
    ]


def streamed(response: dict) -> tuple[list, list, list]:
    """A converse-stream body as (event kinds, content blocks reassembled the way users do,
    the events)."""
    events = list(response["stream"])
    blocks: dict = {}
    for event in events:
        if "contentBlockStart" in event:
            start = event["contentBlockStart"]
            tool = start["start"]["toolUse"]
            blocks[start["contentBlockIndex"]] = {
                "toolUse": {"toolUseId": tool["toolUseId"], "name": tool["name"], "input": ""}
            }
        elif "contentBlockDelta" in event:
            delta = event["contentBlockDelta"]
            block = blocks.setdefault(delta["contentBlockIndex"], {"text": ""})
            if "text" in delta["delta"]:
                block["text"] += delta["delta"]["text"]
            else:
                block["toolUse"]["input"] += delta["delta"]["toolUse"]["input"]
    content = [blocks[i] for i in sorted(blocks)]
    for block in content:
        if "toolUse" in block:
            block["toolUse"]["input"] = json.loads(block["toolUse"]["input"])
    return [next(iter(e)) for e in events], content, events


def request_path(client, model: str) -> None:
    plain = client.converse(modelId=model, messages=QUESTION, inferenceConfig=GREEDY)
    plain_tokens = converse_prompt(plain["usage"])

    # toolConfig reaches the template for every toolChoice; the answer's blocks are well formed,
    # streamed and not.
    for choice in (None, {"auto": {}}, {"any": {}}, {"tool": {"name": "get_weather"}}):
        config = TOOLS if choice is None else dict(TOOLS, toolChoice=choice)
        request = {"modelId": model, "messages": QUESTION, "toolConfig": config,
                   "inferenceConfig": GREEDY}
        served = client.converse(**request)
        assert converse_prompt(served["usage"]) > plain_tokens + 50, (choice, served["usage"])
        assert served["stopReason"] in ("end_turn", "max_tokens", "tool_use"), served
        content = served["output"]["message"]["content"]
        kinds, streamed_content, events = streamed(client.converse_stream(**request))
        assert streamed_content == content, (streamed_content, content)
        assert kinds[0] == "messageStart" and kinds[-2:] == ["messageStop", "metadata"], kinds
        assert events[-2]["messageStop"]["stopReason"] == served["stopReason"], events[-2]

    # A forced call is enforced while decoding: one well-formed toolUse block of the named tool.
    unit = {"toolSpec": {"name": "get_unit", "inputSchema": {"json": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"], "additionalProperties": False}}}}
    for choice in ({"tool": {"name": "get_unit"}}, {"any": {}}):
        forced = {"modelId": model, "messages": QUESTION,
                  "toolConfig": {"tools": [unit], "toolChoice": choice},
                  "inferenceConfig": {"maxTokens": 200, "temperature": 0}}
        served = client.converse(**forced)
        assert served["stopReason"] == "tool_use", served
        uses = [b["toolUse"] for b in served["output"]["message"]["content"] if "toolUse" in b]
        assert uses and all(u["name"] == "get_unit" for u in uses), served
        assert all(u["input"]["unit"] in ("c", "f") for u in uses), uses
        _, streamed_content, _ = streamed(client.converse_stream(**forced))
        # Ids differ per response; the calls themselves are the same.
        calls = lambda content: [(b["toolUse"]["name"], b["toolUse"]["input"]) for b in content]
        assert calls(streamed_content) == calls(served["output"]["message"]["content"]), (
            streamed_content, served)

    # A tool round reaches the template: the synthesized tokenizer is byte-level, so the prompt
    # grows by exactly the bytes added to the tool's result or to the call's input.
    def count(messages: list) -> int:
        answer = client.converse(
            modelId=model, messages=messages, toolConfig=TOOLS, inferenceConfig=GREEDY
        )
        assert answer["stopReason"] in ("end_turn", "max_tokens", "tool_use"), answer
        return converse_prompt(answer["usage"])

    short = count(conversation("18"))
    assert count(conversation("18 and sunny")) == short + len(" and sunny"), short
    assert count(conversation("18", city="Parisian")) == short + len("ian"), short
    json_result = conversation("18")
    json_result[-1]["content"][0]["toolResult"]["content"] = [{"json": {"c": 18}}]
    json_result[-1]["content"][0]["toolResult"]["status"] = "error"
    assert count(json_result) == short - len("18") + len('{"c":18}'), short
    kinds, _, _ = streamed(client.converse_stream(
        modelId=model, messages=conversation("18"), toolConfig=TOOLS, inferenceConfig=GREEDY
    ))
    assert kinds[-2:] == ["messageStop", "metadata"], kinds

    # Bad configurations and misplaced blocks are ValidationExceptions.
    def refused(expected: str, **fields) -> None:
        request = {"modelId": model, "messages": QUESTION, "inferenceConfig": GREEDY, **fields}
        try:
            client.converse(**request)
        except ClientError as e:
            error = e.response["Error"]
            assert error["Code"] == "ValidationException", e.response
            assert error["Message"].startswith(expected), (expected, error)
            return
        raise AssertionError(f"accepted: {fields}")

    refused("toolConfig.tools: tool names must be unique", toolConfig={"tools": [WEATHER, WEATHER]})
    refused(
        "toolConfig.tools.0.toolSpec.inputSchema.json",
        toolConfig={"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": "object"}}}]},
    )
    refused("toolConfig.toolChoice", toolConfig=dict(TOOLS, toolChoice={"tool": {"name": "nope"}}))
    refused(
        "messages.0.content.0: toolUse blocks belong in assistant messages",
        messages=[{"role": "user", "content": [
            {"toolUse": {"toolUseId": "t", "name": "get_weather", "input": {}}}]}],
    )
    # botocore itself refuses a toolSpec without a name, so raw HTTP checks the server does too.
    request = urllib.request.Request(
        f"{client.meta.endpoint_url}/model/{model}/converse",
        data=json.dumps({"messages": QUESTION, "toolConfig": {"tools": [
            {"toolSpec": {"inputSchema": {"json": {}}}}]}}).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("a tool without a name was accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        assert e.headers["x-amzn-errortype"] == "ValidationException", dict(e.headers)
        message = json.loads(e.read())["message"]
        assert message.startswith("toolConfig.tools.0.toolSpec.name"), message


def serve_recorded(directory: pathlib.Path) -> http.server.ThreadingHTTPServer:
    """Answers `/model/<case>/converse` with `<case>.json` and `.../converse-stream` with
    `<case>.stream`, whatever the request."""

    class Recorded(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            _, _, case, operation = self.path.split("/")
            if operation == "converse-stream":
                body = (directory / f"{case}.stream").read_bytes()
                kind = "application/vnd.amazon.eventstream"
            else:
                body = (directory / f"{case}.json").read_bytes()
                kind = "application/json"
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def framing(directory: pathlib.Path) -> None:
    server = serve_recorded(directory)
    client = client_for(f"http://127.0.0.1:{server.server_address[1]}")

    def load(case: str):
        request = {"modelId": case, "messages": QUESTION, "toolConfig": TOOLS}
        whole = client.converse(**request)
        return whole, streamed(client.converse_stream(**request))

    whole, (kinds, content, events) = load("hermes_two_calls")
    assert whole["stopReason"] == "tool_use", whole
    blocks = whole["output"]["message"]["content"]
    assert blocks[0] == {"text": "Checking.\n"}, blocks
    weather, time = blocks[1]["toolUse"], blocks[2]["toolUse"]
    assert (weather["name"], weather["input"]) == ("get_weather", {"city": "Paris"}), weather
    assert (time["name"], time["input"]) == ("get_time", {}), time
    assert weather["toolUseId"] != time["toolUseId"], (weather, time)
    assert content == blocks, (content, blocks)
    assert kinds == [
        "messageStart",
        "contentBlockDelta", "contentBlockStop",
        "contentBlockStart", "contentBlockDelta", "contentBlockStop",
        "contentBlockStart", "contentBlockDelta", "contentBlockStop",
        "messageStop", "metadata",
    ], kinds
    assert events[-2]["messageStop"]["stopReason"] == "tool_use", events[-2]

    whole, (kinds, content, events) = load("hermes_malformed")
    blocks = whole["output"]["message"]["content"]
    assert blocks == [{"text": '<tool_call>{"name": oops}</tool_call>'}], blocks
    assert whole["stopReason"] == "max_tokens" and content == blocks, (whole, content)
    assert "contentBlockStart" not in kinds, kinds

    whole, (kinds, content, events) = load("llama_json")
    blocks = whole["output"]["message"]["content"]
    assert [list(b) for b in blocks] == [["toolUse"]], blocks
    assert blocks[0]["toolUse"]["input"] == {"city": "Oslo"}, blocks
    assert content == blocks and whole["stopReason"] == "tool_use", (content, whole)

    whole, (kinds, content, events) = load("no_tools")
    blocks = whole["output"]["message"]["content"]
    assert blocks == [{"text": "<tool_call>{}</tool_call>"}] and content == blocks, blocks
    assert whole["stopReason"] == "end_turn", whole
    server.shutdown()


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
        request_path(client_for(args.base_url), args.model)
    print("boto3", boto3.__version__, "botocore", botocore.__version__, "tools ok")


if __name__ == "__main__":
    main()
