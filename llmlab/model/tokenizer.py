"""The model's own tokenizer and chat template (HF tokenizers), plus incremental
detokenization: text grows as tokens arrive, only complete UTF-8 is shown, and a stop
string is never shown even when it spans several tokens (as vLLM does it)."""
from __future__ import annotations

import functools


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer   # slow to import: only when a model has a tokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw prompt. Special-token text in it ("<|im_start|>") becomes the
        special token: the prompt is the caller's own, as in vLLM's /v1/completions."""
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The most characters of text one token can stand for: its longest vocabulary entry.
        An entry is at least as long as the text it covers: a byte-level BPE entry has one
        character per byte (and a character is at least one byte), a SentencePiece entry one
        per character ("▁" for a space), a byte-fallback entry "<0xE3>" six for one byte."""
        return max(len(token) for token in self.hf.get_vocab())

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of `text`, without encoding it: the tokens
        split the (normalized) text between them, none taking more than max_chars_per_token
        characters. (It holds for tokenizers that drop no characters: byte-level BPE and
        SentencePiece, the families llmlab loads; a BERT-style pre-tokenizer drops spaces.)
        A server checks it to refuse a 1 MB prompt at once instead of counting its tokens."""
        normalizer = self.hf.backend_tokenizer.normalizer
        if normalizer is not None:   # e.g. NFC, which can merge a few characters into one
            text = normalizer.normalize_str(text)
        return -(-len(text) // self.max_chars_per_token)

    def render_chat(self, messages: list[dict]) -> str:
        """The text of a conversation as the chat template writes it (no tokens)."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the prompt for the assistant's turn.

        Only the template's own markers become special tokens: special-token text inside a
        message ("<|im_end|>\n<|im_start|>system ...") is tokenized as plain text, or any
        user could forge a system turn. HF's `sanitize_control_tokens` does it: it wraps such
        text in the messages with private markers before rendering, then tokenizes the marked
        pieces without special tokens and the rest as usual, so a conversation without such
        text gets exactly the ids it always had. (It never toggles the shared tokenizer's
        `split_special_tokens` setting, so tokenizer threads can share one tokenizer.)"""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        # the template already writes any BOS token, so no special tokens are added again
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                           sanitize_control_tokens=True)


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text, one token at a time.

    It decodes a short window of tokens twice (with and without the newest ones) and
    appends only the difference; a window ending in an incomplete UTF-8 character
    (decoded as U+FFFD) waits for the next token. Text that might be the start of a
    stop string is held back ("pending") until it is known not to be one.

    Work per token does not grow with the output's length: released text is kept as a
    list of pieces (joined only when someone asks for `text`), and the stop-string search
    looks only at the held-back tail plus the new piece, the only place a stop can end.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-6:])   # a little context for leading spaces
        self.prefix_offset = 0                         # window start
        self.read_offset = len(self.token_ids)         # tokens already turned into text
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
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False   # no complete character yet
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        # a stop string ending in the new piece starts at most hold_back characters before it,
        # i.e. inside the pending tail: searching pending + new piece finds every stop once
        window = self.pending + new_text[len(prefix_text):]
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
