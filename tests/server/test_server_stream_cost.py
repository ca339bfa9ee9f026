"""Issue 13: a 4,096-token stream's per-token work in the server does not grow with the
position. Shown with counters, not timings: the characters of cumulative output the
server reads (it must read none: only each step's delta), and the bytes of every event
it sends (a constant envelope around the new text)."""
from __future__ import annotations

import json

import httpx
import pytest

from llmlab.request import RequestOutput
from llmlab.server.app import create_app
from helpers.server import running, tiny_engine

NUM_TOKENS = 4096


@pytest.fixture
def cumulative_reads(monkeypatch):
    """Characters (or token ids) materialized by reading RequestOutput.text / .token_ids."""
    reads = {"text": 0, "token_ids": 0}

    def counting(name):
        view = getattr(RequestOutput, name)

        def read(self):
            value = view.fget(self)
            reads[name] += len(value)
            return value
        return property(read, doc=view.__doc__)

    for name in reads:
        monkeypatch.setattr(RequestOutput, name, counting(name))
    return reads


@pytest.mark.slow
def test_a_4096_token_stream_does_constant_work_per_token(cumulative_reads):
    app = create_app(tiny_engine())
    payload = {"prompt": [5, 6, 7], "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0.0,
               "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with running(app) as url, httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=300) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert sum(map(len, texts)) == NUM_TOKENS            # one character per token (CharTokenizer)
    assert chunks[-1]["usage"]["completion_tokens"] == NUM_TOKENS
    # the server never read the growing cumulative text or token ids, only deltas
    assert cumulative_reads == {"text": 0, "token_ids": 0}
    # every event before the last is the same envelope around its new text: at token 4,000
    # it is no bigger than at token 1 (an event merging k queued tokens carries k characters)
    middle = [(line, c["choices"][0]["text"]) for line, c in zip(events, chunks)
              if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(middle) > NUM_TOKENS // 2
    envelopes = {len(line.encode()) - len(json.dumps(text)) for line, text in middle}
    assert len(envelopes) == 1, envelopes
