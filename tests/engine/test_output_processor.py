"""The output processor (llmlab/engine/output.py), the one home of text-level stops: a
stop string is found even when it spans tokens and is never shown, only complete UTF-8
comes out, and a stop string ends a request with "stop" even on the token that also
reached max_tokens (a token-level stop, the scheduler's).

A byte-level toy tokenizer stands in for the model's: each token id is a few bytes, and
bytes that end mid-character decode to U+FFFD, as HF's byte-level tokenizers do."""
from __future__ import annotations

import pytest
import torch

from llmlab import EngineConfig, LLMEngine, SamplingParams
from llmlab.config import ModelConfig
from llmlab.engine.output import OutputProcessor
from llmlab.model.llama import LlamaModel
from llmlab.request import Request


class ByteTokenizer:
    """Token id -> bytes (`pieces`, else `default`); decodes as UTF-8, U+FFFD for a cut character."""
    eos_token_id = None

    def __init__(self, pieces: dict[int, bytes], default: bytes = b"a"):
        self.pieces, self.default = pieces, default

    def decode(self, token_ids, skip_special_tokens=True) -> str:
        return b"".join(self.pieces.get(t, self.default) for t in token_ids).decode("utf-8", errors="replace")


def stream(pieces: dict[int, bytes], token_ids: list[int], stop: list[str]):
    """Feed a request its tokens one at a time, as the engine does after each step: the
    text each token released, and the index of the token a stop string ended it at (None:
    it ended after the last token for another reason, which releases the held-back tail)."""
    processor = OutputProcessor(ByteTokenizer({0: b"", **pieces}), eos_token_ids=set())
    request = Request("0", None, [0], SamplingParams(stop=stop))
    processor.add_request(request)
    deltas = []
    for i, token in enumerate(token_ids):
        request.output_token_ids.append(token)
        stopped = processor.add_tokens([request])
        deltas.append(processor.outputs([request])[0].delta_text)
        if stopped:
            assert stopped == [request]
            return deltas, i
    processor.finish(request)
    deltas.append(processor.outputs([request])[0].delta_text)
    return deltas, None


def test_a_stop_string_split_across_tokens_is_found_and_never_shown():
    pieces = {1: b"He", 2: b"llo", 3: b" wo", 4: b"rld"}
    deltas, stopped_at = stream(pieces, [1, 2, 3, 4], stop=["lo w"])
    assert stopped_at == 2                       # " wo" completes "lo w"
    assert "".join(deltas) == "Hel"              # the text before the stop, nothing of it
    assert deltas == ["", "He", "l"]             # "He" waited: it might have begun the stop
    # two stop strings in the same text: the earliest wins, not the first listed
    assert "".join(stream(pieces, [1, 2, 3, 4], stop=["wo", "lo w"])[0]) == "Hel"


def test_a_partial_stop_string_is_released_when_the_request_ends_otherwise():
    deltas, stopped_at = stream({1: b"Hel", 2: b"lo w"}, [1, 2], stop=["lo wo"])
    assert stopped_at is None
    assert deltas == ["", "Hel", "lo w"]         # held back until the request ended


def test_utf8_is_never_split():
    pieces = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b"\xe2\x82", 5: b"\xac"}   # "caf", "é" and "€" cut in bytes
    deltas, stopped_at = stream(pieces, [1, 2, 3, 4, 5], stop=[])
    assert stopped_at is None
    assert deltas[:5] == ["caf", "", "é", "", "€"] and "".join(deltas) == "café€"
    # a stop string made of cut characters: found once they are whole, never shown
    deltas, stopped_at = stream(pieces, [1, 2, 3, 4, 5], stop=["é€"])
    assert stopped_at == 4 and "".join(deltas) == "caf" and not any("\ufffd" in d for d in deltas)


# ---- through the engine: the scheduler's token-level stops meet the text-level one ----------------
TINY = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128))
MODEL = LlamaModel.random(TINY, torch.float32, "cpu", seed=0)


def generate(params: SamplingParams, async_scheduling: bool):
    """Every output of one request on an engine whose every token decodes to "a"."""
    config = EngineConfig(device="cpu", dtype="float32", backend="torch", block_size=4, num_gpu_blocks=16,
                          max_num_batched_tokens=32, async_scheduling=async_scheduling)
    engine = LLMEngine(config, model=MODEL, tokenizer=ByteTokenizer({}, default=b"a"))
    engine.add_request([1, 2, 3], params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    stats = engine.kv_stats()
    assert stats["free_device_blocks"] == stats["total_device_blocks"] and not engine.requests
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_string_on_the_max_tokens_token_ends_with_stop(async_scheduling):
    stopped = generate(SamplingParams(max_tokens=3, temperature=0.0, stop=["aaa"]), async_scheduling)
    assert stopped[-1].finished and stopped[-1].finish_reason == "stop"
    assert len(stopped[-1].token_ids) == 3 and stopped[-1].text == ""
    assert "".join(o.delta_text for o in stopped) == ""          # no "a" of the stop ever shown
    # the same request without a stop string that can match ends by length, its text whole
    longer = generate(SamplingParams(max_tokens=3, temperature=0.0, stop=["aaaa"]), async_scheduling)
    assert longer[-1].finish_reason == "length" and longer[-1].text == "aaa"
    assert "".join(o.delta_text for o in longer) == "aaa"
    # a stop string before max_tokens: "stop", the tokens up to it kept
    early = generate(SamplingParams(max_tokens=8, temperature=0.0, stop=["aa"]), async_scheduling)
    assert early[-1].finish_reason == "stop" and len(early[-1].token_ids) == 2 and early[-1].text == ""
