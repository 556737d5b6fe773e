"""The whole prompt of a usage object, on the surfaces that split it over the prefix cache.

Anthropic's `input_tokens` and Converse's `inputTokens` count the prompt tokens neither read
from the cache nor written to it; the prompt is their sum with the two cache counts.
"""


def anthropic_prompt(usage) -> int:
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


def converse_prompt(usage: dict) -> int:
    return (
        usage["inputTokens"]
        + usage.get("cacheReadInputTokens", 0)
        + usage.get("cacheWriteInputTokens", 0)
    )
