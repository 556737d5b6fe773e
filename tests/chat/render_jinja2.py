"""Render tests/chat/conversations.json with Python's Jinja2, the way HF transformers'
`apply_chat_template` sets it up, so the Rust renderer (model/src/chat.rs) can be compared
against it byte for byte.

The environment mirrors transformers: an ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and loop controls; a `tojson` filter that is plain `json.dumps` (no HTML
escaping, non-ASCII kept); globals `raise_exception` and `strftime_now`. The context is
`messages`, `tools` (None when absent), `documents` (None), `add_generation_prompt`, the
special tokens the tokenizer config sets, then every extra keyword of the conversation.
transformers itself is not imported: the environment is small and pinning Jinja2 is enough.

Output: {template_name: {conversation_name: rendered_text | {"error": message}}}.
"""

import argparse
import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEMPLATES = ("qwen3", "llama3_1")


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def special_token(value):
    """A special token in tokenizer_config.json is a string or an AddedToken object."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def pick_template(chat_template, tools):
    """The named-list form selects like transformers: tool_use when tools are given and the
    checkpoint has one, else default."""
    if isinstance(chat_template, str):
        return chat_template
    named = {entry["name"]: entry["template"] for entry in chat_template}
    if tools is not None and "tool_use" in named:
        return named["tool_use"]
    return named["default"]


def render_one(env, config, conversation):
    tools = conversation.get("tools")
    source = pick_template(config["chat_template"], tools)
    context = {}
    for key in ("bos_token", "eos_token"):
        token = special_token(config.get(key))
        if token is not None:
            context[key] = token
    context.update(conversation.get("extra", {}))
    context.update(
        messages=conversation["messages"],
        tools=tools,
        add_generation_prompt=conversation.get("add_generation_prompt", False),
    )
    context.setdefault("documents", None)
    try:
        return env.from_string(source).render(**context)
    except jinja2.exceptions.TemplateError as err:
        return {"error": str(err)}
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", type=pathlib.Path, default=ROOT / "target/test-data/tokenizers")
    parser.add_argument("--conversations", type=pathlib.Path, default=ROOT / "tests/chat/conversations.json")
    parser.add_argument("--output", type=pathlib.Path, default=ROOT / "target/test-data/chat-expected.json")
    args = parser.parse_args()

    conversations = json.loads(args.conversations.read_text(encoding="utf-8"))
    env = environment()
    expected = {}
    for name in TEMPLATES:
        config_path = args.tokenizers / name / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        expected[name] = {c["name"]: render_one(env, config, c) for c in conversations}

    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(expected, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
