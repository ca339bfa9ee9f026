"""Log-probabilities in OpenAI's two shapes, from the engine's `TokenLogprob`s.

The engine gives, per token, its logprob and the k most likely tokens there
(`SamplingParams.logprobs`; `prompt_logprobs` for a prompt's tokens, None for the first, which
nothing predicts). A sampled token's logprob is under the distribution it was drawn from
(temperature, top-k, top-p, min-p applied; a greedy request's are the model's own); a prompt
token's is the model's own. The server only names and shapes them:

  chat         choices[i].logprobs = {"content": [{token, logprob, bytes,
                                                   top_logprobs: [{token, logprob, bytes}] x k}]}
  completions  choices[i].logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}],
                                      text_offset}  (the legacy shape; with echo the prompt's tokens
               come first, null logprob and null top_logprobs for the first one). As in OpenAI's
               and vLLM's, a position's top_logprobs dict holds the k most likely and the chosen
               token, so up to k + 1 entries: lm-evaluation-harness calls a token greedy when its
               logprob is the dict's largest value.

A token is named by the tokenizer's decoding of it alone (`Tokenizer.token_text`: special
tokens written out, "\\ufffd" for a piece of a UTF-8 character, whose real bytes `bytes` gives);
an engine without a tokenizer (token ids in and out) names token 42 "token_id:42", as vLLM's
`--return-tokens-as-token-ids` does. A token the filters cut has logprob -inf, which JSON
cannot carry: it is sent as -9999.0, vLLM's value.
"""
from __future__ import annotations

import math

from llmlab.request import TokenLogprob

LOWEST_LOGPROB = -9999.0     # what -inf is sent as (vLLM's clamp)


def clamp(logprob: float) -> float:
    return LOWEST_LOGPROB if math.isnan(logprob) else max(logprob, LOWEST_LOGPROB)


class TokenNames:
    """How tokens are named in logprobs: their text and bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        if not hasattr(self.tokenizer, "token_text"):     # a test's stand-in tokenizer
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.token_text(token_id)

    def bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is None or not hasattr(self.tokenizer, "token_bytes"):
            return list(self.text(token_id).encode("utf-8"))
        return list(self.tokenizer.token_bytes(token_id))


def chat_logprobs(entries: list[TokenLogprob], names: TokenNames) -> dict:
    """OpenAI's chat `logprobs` object for some output tokens."""
    def named(token_id: int, logprob: float) -> dict:
        return {"token": names.text(token_id), "logprob": clamp(logprob), "bytes": names.bytes(token_id)}
    return {"content": [{**named(e.token_id, e.logprob), "top_logprobs": [named(t, lp) for t, lp in e.top]}
                        for e in entries]}


class CompletionLogprobs:
    """Builds the legacy completions `logprobs` object of one choice, a piece at a time (a
    stream sends each chunk's tokens), keeping the running text offset between pieces."""

    def __init__(self, names: TokenNames):
        self.names = names
        self.offset = 0     # characters of token text so far: the next token's text_offset

    def piece(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The object for these tokens (an entry None: a token nothing predicts, the prompt's first)."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            name = self.names.text(token_id)
            tokens.append(name)
            text_offset.append(self.offset)
            self.offset += len(name)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(clamp(entry.logprob))
            top = {}
            for t, lp in entry.top:     # most likely first: a name two tokens share keeps the likelier
                top.setdefault(self.names.text(t), clamp(lp))
            top.setdefault(name, clamp(entry.logprob))    # the chosen token is always there
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}
