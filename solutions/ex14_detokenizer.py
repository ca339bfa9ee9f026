"""Exercise 14 -- the incremental detokenizer with stop strings: a request's text as it
streams, one token at a time. Difficulty: ** (no Triton; Python only; about 60 minutes)

Read first: notebooks/10_sampling.ipynb and notebooks/11_serving_and_benchmarking.ipynb
(streaming). Use: the tokenizer's `decode(token_ids) -> str` only (a byte-level BPE: one
token may be part of a character, and bytes that end mid-character decode to U+FFFD).
Nothing of llmlab/ is needed.

Task
    The engine hands each request's new token to its OutputText, which asks its
    IncrementalDetokenizer for the text that token completes, and shows text as it comes.
    Write:
      IncrementalDetokenizer.add_token(token_id)  the text the token completes, "" while a
              character is incomplete. Decoding token by token is wrong (a character split
              over two tokens decodes to U+FFFD twice; with a SentencePiece tokenizer, which
              llmlab also loads, a token's leading space can vanish when decoded alone):
              decode a short window of the recent tokens with and without the newest ones
              and return the difference; a window whose text ends in U+FFFD waits for the
              next token. Work per token must not grow with the output's length.
      OutputText.add_token(token_id)  append the new text; returns True when a stop string
              appeared: the text is then cut before it (stopped_on = that stop string), and
              the stop string is never shown, even when it spans several tokens. Text that
              may be the start of a stop string is held back (`pending`, at most
              hold_back = longest stop - 1 characters) until it can no longer be one.
      OutputText.finish()  the request ended for another reason: release the held-back tail.
    Shown text goes out through self._release(text) (it keeps `pieces`, `text`, `take_delta`).

State (set up in __init__; the engine reads it)
    IncrementalDetokenizer: token_ids (a little prompt context, then the output),
        prefix_offset (the window's start), read_offset (tokens already turned into text)
    OutputText: pieces (released text), pending (held back), stopped_on, hold_back

Hints
    - A stop string that ends in the new piece starts inside pending + piece: search there
      only (and take the earliest match when several stop strings appear).
    - After a search that finds nothing, release all but the last hold_back characters.

What you will have built: the streaming text side of an engine (vLLM's detokenizer and
stop-string handling); the grader runs the real engine with yours
(LLMEngine(config, detokenizer=IncrementalDetokenizer, output_text=OutputText)).

Grade: `make grade EX=ex14`, or `pytest tests/exercises/test_ex14_detokenizer.py --impl=exercises`.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text, one token at a time.

    It decodes a short window of tokens twice (with and without the newest ones) and
    returns only the difference; a window ending in an incomplete UTF-8 character
    (decoded as U+FFFD) waits for the next token. Work per token does not grow with the
    output's length. What of the text is shown, and stop strings, are OutputText's
    (below).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-6:])   # a little context for leading spaces
        self.prefix_offset = 0                         # window start
        self.read_offset = len(self.token_ids)         # tokens already turned into text

    def add_token(self, token_id: int) -> str:
        """Append one token; returns the text it completes ("" while a character is incomplete)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""   # no complete character yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]


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
