"""The model's own tokenizer and chat template (HF tokenizers), plus incremental
detokenization: text grows as tokens arrive, only complete UTF-8 is shown, and a stop
string is never shown even when it spans several tokens (as vLLM does it)."""
from __future__ import annotations



class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer   # slow to import: only when a model has a tokenizer

        self.hf = AutoTokenizer.from_pretrained(path)
        self.eos_token_id = self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation, ending with the prompt for the assistant's turn."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # the template already writes any BOS token, so don't add special tokens again
        return self.hf.encode(text, add_special_tokens=False)


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text, one token at a time.

    It decodes a short window of tokens twice (with and without the newest ones) and
    appends only the difference; a window ending in an incomplete UTF-8 character
    (decoded as U+FFFD) waits for the next token. Text that might be the start of a
    stop string is held back until it is known not to be one.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-6:])   # a little context for leading spaces
        self.prefix_offset = 0                         # window start
        self.read_offset = len(self.token_ids)         # tokens already turned into text
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.full_text = ""                            # everything decoded so far
        self.stopped_on: str | None = None

    @property
    def text(self) -> str:
        """Text safe to show: no partial stop string at its end."""
        if self.stopped_on is not None or not self.hold_back:
            return self.full_text
        return self.full_text[: max(0, len(self.full_text) - self.hold_back)]

    def finish(self) -> None:
        """The request ended for another reason: release the held-back tail."""
        self.hold_back = 0

    def add_token(self, token_id: int) -> bool:
        """Append one token; returns True when a stop string appeared (text is cut before it)."""
        self.token_ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False   # no complete character yet
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        search_from = max(0, len(self.full_text) - self.hold_back)
        self.full_text += delta
        found = [(at, stop) for stop in self.stop
                 if (at := self.full_text.find(stop, search_from)) != -1]
        if found:
            at, self.stopped_on = min(found)   # the earliest stop string wins
            self.full_text = self.full_text[:at]
            return True
        return False
