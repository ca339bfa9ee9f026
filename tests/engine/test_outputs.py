"""Delta outputs: every step's RequestOutput carries what is new (delta_text,
delta_token_ids) next to the cumulative text / token_ids, and the cumulative views are
snapshots that later steps do not change."""
from __future__ import annotations

import pytest

from llmlab import SamplingParams
from llmlab.engine.output import OutputText
from llmlab.model.tokenizer import IncrementalDetokenizer


def stream(llm, prompt, params):
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


@pytest.mark.slow
def test_deltas_add_up_to_the_cumulative_output(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    outputs = stream(llm, "The capital of France is", params)
    final = llm.generate("The capital of France is", params)[0]
    assert "".join(o.delta_text for o in outputs) == outputs[-1].text == final.text
    assert [t for o in outputs for t in o.delta_token_ids] == outputs[-1].token_ids == final.token_ids
    assert all(len(o.delta_token_ids) == 1 for o in outputs)   # one step, one token
    # each output is a snapshot of its own step, not a live view of the request
    for i, o in enumerate(outputs):
        assert len(o.token_ids) == i + 1
        assert o.text == "".join(p.delta_text for p in outputs[:i + 1])


@pytest.mark.slow
def test_stop_string_deltas_never_show_the_stop(llm):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    full = llm.generate("Count: 1, 2, 3, 4,", params)[0].text
    stop = full.strip().split()[2]           # a word from the middle of the answer
    outputs = stream(llm, "Count: 1, 2, 3, 4,", SamplingParams(max_tokens=12, temperature=0.0, stop=[stop]))
    streamed = "".join(o.delta_text for o in outputs)
    assert outputs[-1].finish_reason == "stop"
    assert streamed == outputs[-1].text == full[:full.index(stop)]


class CountingTokenizer:
    """Wraps a tokenizer and counts the characters its decode calls produce."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded_chars = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        text = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self.decoded_chars += len(text)
        return text


def test_detokenizer_work_per_token_does_not_grow_with_position(llm):
    """A long stream's per-token work is constant: the characters decoded and searched
    for stop strings per token are the same at token 100 and at token 2,000."""
    counting = CountingTokenizer(llm.tokenizer)
    detok = OutputText(IncrementalDetokenizer(counting, [1, 2, 3]), stop=["<never appears>"])
    word = llm.tokenizer.encode(" hello")[-1]
    per_token = []
    for i in range(2000):
        before = counting.decoded_chars
        detok.add_token(word)
        detok.take_delta()
        per_token.append(counting.decoded_chars - before)
    assert max(per_token[1000:]) <= max(per_token[:100])
    assert len(detok.pending) <= len("<never appears>")
    assert detok.text + detok.pending == " hello" * 2000   # the tail is held back...
    detok.finish()
    assert detok.text == " hello" * 2000                   # ...until the request ends
