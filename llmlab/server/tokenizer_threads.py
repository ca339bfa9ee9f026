"""Prompts become token ids on tokenizer threads, so that a flood of huge prompts stalls
nobody else.

Tokenizing is slow for big prompts (a 900 KB prompt takes HF's tokenizer ~0.6 s): on the
event loop it would stop every connection, on the engine thread every stream. HF's
tokenizer releases the GIL while it encodes, so threads encode while the engine steps.
Two more things keep a flood of huge prompts from delaying a small request:

  * a prompt that cannot fit is refused before it is encoded: `Tokenizer.min_num_tokens`
    bounds its token count from its length in characters (no token stands for more than
    the longest vocabulary entry: 81 characters for SmolLM2), so a 1 MB prompt is refused
    at once, and no prompt costs more than max_model_len x 81 characters of encoding;
  * two lanes, like a shop's express checkout: prompts up to SHORT_PROMPT_CHARS characters
    are tokenized on threads of their own, so a short one never queues behind a long one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os

from llmlab.engine.engine import LLMEngine
from llmlab.request import ContextLengthError

# the express lane: ~4k tokens of text, which the tokenizer encodes in a few milliseconds
SHORT_PROMPT_CHARS = 16_384
SHORT_LANE_THREADS = 2
# a long prompt keeps a core busy while it is encoded: half the cores at most, and 4
LONG_LANE_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


class TokenizerLanes:
    """The tokenizer threads of one engine, in a short-prompt and a long-prompt lane."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.short_lane: concurrent.futures.ThreadPoolExecutor | None = None
        self.long_lane: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        self.short_lane = concurrent.futures.ThreadPoolExecutor(SHORT_LANE_THREADS,
                                                                thread_name_prefix="llmlab-tokenizer-short")
        self.long_lane = concurrent.futures.ThreadPoolExecutor(LONG_LANE_THREADS,
                                                               thread_name_prefix="llmlab-tokenizer-long")

    def stop(self) -> None:
        for lane in (self.short_lane, self.long_lane):
            if lane is not None:
                lane.shutdown(cancel_futures=True)
        self.short_lane = self.long_lane = None

    async def tokenize(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        """`tokenize(...)` on a thread of the prompt's lane."""
        lane = self.short_lane if num_chars(prompt, messages) <= SHORT_PROMPT_CHARS else self.long_lane
        return await asyncio.get_running_loop().run_in_executor(lane, tokenize, self.engine, prompt, messages)


def num_chars(prompt, messages) -> int:
    """A prompt's length in characters, to choose its lane (token ids: 0)."""
    if messages is not None:
        return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    return len(prompt) if isinstance(prompt, str) else 0


def tokenize(engine: LLMEngine, prompt: str | list[int] | None, messages: list[dict] | None) -> list[int]:
    """Token ids of a prompt (text or ids) or of chat messages (the model's chat template),
    by the engine's one tokenization point. ContextLengthError, before encoding, for a text
    that certainly has more tokens than the context holds."""
    refuse_what_cannot_fit(engine, prompt, messages)
    return engine.tokenize(messages if messages is not None else prompt)[0]


def refuse_what_cannot_fit(engine: LLMEngine, prompt, messages) -> None:
    """ContextLengthError when a text prompt's or a conversation's token count is certainly
    max_model_len or more (the prompt and one new token must fit), from its length alone.
    A conversation is bounded on its rendered text. A tokenizer with no bound (a test's
    stand-in) is always encoded."""
    from jinja2 import TemplateError

    tokenizer = engine.tokenizer
    if not hasattr(tokenizer, "min_num_tokens"):
        return
    if messages is not None:
        try:
            text = tokenizer.render_chat(messages)
        except (TemplateError, TypeError, UnicodeError, ValueError):
            return    # engine.tokenize says what is wrong, in its own words
    elif isinstance(prompt, str):
        text = prompt
    else:
        return        # token ids: counted as they are
    at_least = tokenizer.min_num_tokens(text)
    if at_least >= engine.max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {engine.max_model_len} tokens, but the prompt has at least "
            f"{at_least} ({len(text)} characters, and no token of this tokenizer stands for more than "
            f"{tokenizer.max_chars_per_token}; the prompt and at least one new token must fit)")
