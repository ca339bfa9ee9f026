"""Notebook 13, quantizing the KV cache: a block's bytes from the cache's own sizing, a row's
codes from the reference quantizer."""
from __future__ import annotations

import torch

from llmlab import kernels
from llmlab.bench.common import LLAMA3_8B
from llmlab.cache.kv_cache import bytes_per_block
from llmlab.config import ModelConfig
from llmlab.teach.check import choice, integer, right, wrong


def q1(answer):
    """The notebook prints SmolLM2's bytes per block. How many bytes does one 16-token block of
    Llama-3-8B's int8 cache take (32 layers, 8 kv heads of 128 channels; codes and scales, K and V)?"""
    n = integer(answer)
    config = ModelConfig.from_hf(LLAMA3_8B)
    if n == bytes_per_block(config, 16, torch.int8):
        return right("every row of 128 codes carries one float32 scale: 132 bytes a row instead of 256 in "
                     "bfloat16, about half the memory.")
    if n == bytes_per_block(config, 16, torch.bfloat16):
        return wrong("that is the bfloat16 cache; an int8 code is one byte.")
    if n == bytes_per_block(config, 16, torch.bfloat16) // 2:
        return wrong("the codes alone; each row (one token, one kv head) also keeps its scale.")
    return wrong("count it as the notebook does for SmolLM2: K and V x layers x 16 tokens x kv heads x (a row of "
                 "one-byte codes + a 4-byte scale).")


ROW = [0.02, -1.27, 0.5]


def q2(answer):
    """int8 with one absmax scale per row: which code does 0.5 get in the row [0.02, -1.27, 0.5]?"""
    code = integer(answer)
    codes, _ = kernels.reference.quantize(torch.tensor([[ROW]]), torch.int8)
    if code == codes[0, 0, 2].item():
        return right("the scale maps the row's largest magnitude, 1.27, onto 127; 0.5 lands on its share of it.")
    if code in (63, 64):
        return wrong("that maps 1.0 onto 127; the scale maps the row's absmax onto 127.")
    return wrong("scale = absmax(row) / 127; code = round(x / scale).")


def q3(answer):
    """llmlab keeps one scale per token and kv head, not KIVI's per channel. The reason it gives:
    (a) per-token scales are more accurate for keys (b) a token's scale is known the moment its key is,
    so store_kv writes it once with the codes (c) fp8 needs per-token scales"""
    letter = choice(answer, "abc")
    if letter == "b":
        return right("a per-channel scale belongs to a whole block of tokens and is known only when the block "
                     "is full; per token, the cache's content does not depend on chunking or batching either.")
    if letter == "a":
        return wrong("the granularity chart says the opposite for keys: per channel is more accurate.")
    return wrong("fp8 keeps relative precision; the notebook compares fp8 with and without scales, but that "
                 "is not the reason.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3}
