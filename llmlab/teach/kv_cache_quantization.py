"""Notebook 13, quantizing the KV cache: a block's bytes from the cache's own sizing, a row's
codes from the reference quantizer, and the notebook's measurements on the embedded model
(the keys' share of the KL, fp8 against int8 row by row) made again with kv_quant."""
from __future__ import annotations

import functools

import torch

from llmlab import kernels
from llmlab.bench import kv_quant
from llmlab.bench.common import LLAMA3_8B
from llmlab.cache.kv_cache import bytes_per_block
from llmlab.config import ModelConfig
from llmlab.teach.check import choice, close, fraction, integer, right, wrong


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


# ---- the notebook's model and text -------------------------------------------------------------
@functools.cache
def model_and_text():
    """The embedded model and the notebook's 512 tokens of the fixed text (`model`, `token_ids`)."""
    import llmlab
    from llmlab.bench.kv_quant_text import text

    llm = llmlab.LLM(num_gpu_blocks=16)
    return llm.engine.model, llm.tokenizer.encode(text())[:512]


def keep(x):
    return x


@functools.cache
def kl_shares() -> dict[str, float]:
    """The mean KL with only the keys, or only the values, quantized (per token-head, the engine's
    scheme), as a fraction of the int8 cache's: the first 256 tokens of the text, one prefill chunk."""
    model, token_ids = model_and_text()
    rows = kv_quant.accuracy(model, token_ids[:256], only=["engine"],
                             schemes={"K only": (kv_quant.per_token_head, keep),
                                      "V only": (keep, kv_quant.per_token_head)})
    kl = {r["cache"]: r["mean_kl"] for r in rows}
    return {name: kl[name] / kl["int8, per token-head (engine)"] for name in ("K only", "V only")}


def q4(answer):
    """Quantize the keys only: kv_quant.accuracy(model, token_ids[:256], only=["engine"], schemes={"K only":
    (key function, value function)}) with the engine's per_token_head for the keys and the values kept as
    they are. Its mean KL, as a fraction of the int8 row's mean KL: how much of the KL comes from the keys?"""
    share = fraction(answer)
    shares = kl_shares()
    if close(share, shares["K only"], 0.03):
        return right("nearly all of it. A key's error shifts every score q.k of the queries that meet it, and the "
                     "softmax turns those shifts into other weights for every value; a value's error only blends "
                     "into the output in proportion to its weight. And the keys are the noisier rows (their "
                     "outlier channels set a coarse step). KIVI spends its care on the keys for that reason.")
    if close(share, shares["V only"], 0.03):
        return wrong("that is what the values leave when they alone are quantized; the question quantizes the keys "
                     "and keeps the values.")
    if close(share, 0.5, 0.05):
        return wrong("measure it rather than split it evenly: keys and values do not cost the model the same.")
    return wrong("run kv_quant.accuracy with schemes={\"K only\": (kv_quant.per_token_head, keep)}, where keep "
                 "returns its rows unchanged, and divide that row's mean_kl by the int8 row's.")


@functools.cache
def fp8_key_rows_better() -> float:
    """The share of the notebook's key rows that fp8 e4m3 per token-head round-trips with a smaller
    relative error than int8 per token-head."""
    model, token_ids = model_and_text()
    keys, _ = kv_quant.capture_kv(model, token_ids)
    int8 = kv_quant.relative_error(keys, kv_quant.per_token_head)
    fp8 = kv_quant.relative_error(keys, kv_quant.fp8_per_token_head)
    return (fp8 < int8).float().mean().item()


def q5(answer):
    """fp8 e4m3 with the same per-row scale (kv_quant.fp8_per_token_head) against int8
    (kv_quant.per_token_head), row by row: on what fraction of the notebook's key rows (`keys`) does fp8
    leave the smaller relative error?"""
    share = fraction(answer)
    expected = fp8_key_rows_better()
    if close(share, expected, 0.005):
        return right("hardly any. e4m3 keeps 3 mantissa bits at every magnitude; int8 has 127 even steps up to "
                     "the row's absmax, finer than e4m3's for most values. fp8 wins only on rows where a few "
                     "channels dwarf the rest (absmax many times the row's rms): there int8's even steps are "
                     "coarse for the small values, while fp8's steps shrink with them.")
    if share > 0.5:
        return wrong("fp8's bar in the granularity chart is about twice int8's: could it win on most rows?")
    if close(share, 0.0, 0.001):
        return wrong("it does win on some rows: compare kv_quant.relative_error(keys, kv_quant.fp8_per_token_head) "
                     "with key_error, row by row.")
    return wrong("(kv_quant.relative_error(keys, kv_quant.fp8_per_token_head) < key_error).float().mean() counts "
                 "them.")


QUESTIONS = {"q1": q1, "q2": q2, "q3": q3, "q4": q4, "q5": q5}
