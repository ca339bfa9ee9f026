"""The output processor: from the tokens a step gave its requests to the RequestOutputs the
engine hands back (vLLM's output processor).

A request stops for one of two kinds of reasons, each decided in one place:
  token-level  EOS (unless ignored), a stop token id, max_tokens, the context length: the
               scheduler's (Scheduler.resolve), which needs no text;
  text-level   a stop string: here, since only the text shows it, and a stop string can
               span several tokens. The engine then has the scheduler finish the request
               ("stop", also when the same token reached max_tokens).
For each new token the processor stamps the first-token time and turns the token into text
(model/tokenizer.py's IncrementalDetokenizer: only complete UTF-8); `OutputText` holds back a
tail that may be the start of a stop string and never shows a stop string. When a request
finishes, for any reason, it stamps the finish time and releases the held-back tail, unless
a stop string cut the text there.
"""
from __future__ import annotations

import time

from llmlab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from llmlab.request import Request, RequestOutput


class OutputText:
    """A request's output text as it is shown: complete UTF-8 only, and no stop string (nor
    the start of one) at its end.

    Work per token does not grow with the output's length: released text is kept as a list
    of pieces (joined only when someone asks for `text`), and the stop-string search looks
    only at the held-back tail plus the new piece, the only place a stop can end.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: list[str]):
        self.detokenizer = detokenizer
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.pieces: list[str] = []                    # released text, in order
        self.pending = ""                              # decoded but held back (a stop may start here)
        self.stopped_on: str | None = None
        self._delta: list[str] = []                    # pieces released since take_delta()
        self._joined, self._num_joined = "", 0

    @property
    def text(self) -> str:
        """Text safe to show: no partial stop string at its end."""
        return self.text_of(len(self.pieces))

    def text_of(self, num_pieces: int) -> str:
        """The text made of the first `num_pieces` released pieces (an output's snapshot)."""
        if num_pieces < self._num_joined:
            return "".join(self.pieces[:num_pieces])
        if num_pieces > self._num_joined:
            self._joined += "".join(self.pieces[self._num_joined:num_pieces])
            self._num_joined = num_pieces
        return self._joined

    def take_delta(self) -> str:
        """Text released since the last call."""
        delta, self._delta = "".join(self._delta), []
        return delta

    def _release(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self._delta.append(text)

    def finish(self) -> None:
        """The request ended for another reason: release the held-back tail."""
        self._release(self.pending)
        self.pending, self.hold_back = "", 0

    def add_token(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string appeared (text is cut before it)."""
        piece = self.detokenizer.add_token(token_id)
        if not piece:
            return False   # no complete character yet
        # a stop string ending in the new piece starts at most hold_back characters before it,
        # i.e. inside the pending tail: searching pending + new piece finds every stop once
        window = self.pending + piece
        found = [(at, stop) for stop in self.stop if (at := window.find(stop)) != -1]
        if found:
            at, self.stopped_on = min(found)   # the earliest stop string wins
            self._release(window[:at])
            self.pending = ""
            return True
        keep = max(0, len(window) - self.hold_back)
        self._release(window[:keep])
        self.pending = window[keep:]
        return False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: set[int],
                 detokenizer=IncrementalDetokenizer, output_text=None):
        """`tokenizer`: None for an engine that runs on token ids only (its outputs have no text).
        `detokenizer`, `output_text`: the classes each request's text is made with
        (IncrementalDetokenizer and OutputText unless an exercise's are plugged in)."""
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer
        self.output_text = OutputText if output_text is None else output_text
        self.eos_token_ids = eos_token_ids   # never detokenized: an end, not text

    def add_request(self, request: Request) -> None:
        """Give a new request its detokenizer and its stop strings."""
        if self.tokenizer is not None:
            detokenizer = self.detokenizer(self.tokenizer, request.prompt_token_ids)
            request.output_text = self.output_text(detokenizer, request.params.stop)

    def add_tokens(self, requests: list[Request]) -> list[Request]:
        """The output side of each request's newest token (the scheduler has just resolved
        it): first-token time, text, stop strings. Returns the requests a stop string ended,
        for the engine to finish with "stop"."""
        stopped = []
        for request in requests:
            token = request.output_token_ids[-1]
            if request.first_token_time is None:
                request.first_token_time = time.perf_counter()
            text = request.output_text
            if text is not None and token not in self.eos_token_ids and text.add_token(token):
                stopped.append(request)
        return stopped

    @staticmethod
    def add_logprobs(step, advanced: list[Request]) -> None:
        """Attach the log-probabilities a step (in_flight.InFlightStep) computed, if any: those
        of its sampled tokens to the requests that took their token this step (`advanced`: a
        request finished meanwhile dropped its token, and drops its logprob too), those of
        prompt tokens to the positions they score (a recomputed prompt scores the same)."""
        if step.logprobs is None and step.prompt_logprobs is None:
            return
        sampled, prompt = step.logprob_entries()
        took = {id(request) for request in advanced}
        for row, entry in sampled:
            if id(step.requests[row]) in took:
                step.requests[row].output_logprobs.append(entry)
        for (request, position), entry in prompt:
            request.prompt_logprobs[position] = entry

    def finish(self, request: Request) -> None:
        """The output side of a request that has finished (for any reason): its end time,
        the held-back text released. EOS and stop token ids end with "stop" too: only a
        matched stop string cuts the text."""
        request.finish_time = time.perf_counter()
        if request.output_text is not None and request.output_text.stopped_on is None:
            request.output_text.finish()

    def outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per request: cumulative text and tokens, and what is new since
        its previous output (RequestOutput.of advances the request's delta counters)."""
        return [RequestOutput.of(request) for request in requests]
