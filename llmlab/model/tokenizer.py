"""The model's own tokenizer and chat template (HF tokenizers); what a prompt (text, token
ids or chat messages) is in tokens; incremental detokenization: text grows as tokens
arrive, and only complete UTF-8 comes out (stop strings are the output processor's:
engine/output.py)."""
from __future__ import annotations

import functools
import numbers

from llmlab.request import ContextLengthError


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

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included ("<|im_end|>"): how a server names
        a token in its logprobs. A token holding part of a UTF-8 character decodes to "\ufffd";
        `token_bytes` has its real bytes."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    @functools.lru_cache(maxsize=65536)
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs `bytes`: a client joins them to
        rebuild characters split between tokens). A byte-level BPE entry ("Ġæ") maps back
        through GPT-2's byte-to-character table; a byte-fallback entry ("<0xE3>") is its byte;
        anything else is its decoded text in UTF-8."""
        entry = self.hf.convert_ids_to_tokens(token_id)
        if entry is not None and type(self.hf.backend_tokenizer.decoder).__name__ == "ByteLevel" \
                and token_id not in self.hf.all_special_ids and all(c in BYTE_OF_CHAR for c in entry):
            return bytes(BYTE_OF_CHAR[c] for c in entry)
        if entry is not None and len(entry) == 6 and entry.startswith("<0x") and entry.endswith(">"):
            return bytes([int(entry[3:5], 16)])
        return self.token_text(token_id).encode("utf-8")

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


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: byte-level BPE writes byte b as one printable
    character (itself for printable ASCII and Latin-1, else chr(256 + i))."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_OF_CHAR = _byte_of_char()


def template_message(message: dict) -> dict:
    """A chat message as chat templates take it: its content one string. OpenAI's content
    parts (`[{"type": "text", "text": ...}, ...]`) are joined, a null content (an assistant
    turn that only called tools) is "", and "developer" (OpenAI's newer name for the
    system role) is "system". The server's messages and LLM.chat's both come through here."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        content = "".join(part["text"] for part in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ValueError('chat message content must be a string or a list of {"type": "text", "text": ...} parts '
                         f"(the only kind this model reads), got {content!r:.200}")
    role = message.get("role")
    return {**message, "role": "system" if role == "developer" else role, "content": content}


def tokenize_prompt(tokenizer: Tokenizer | None, prompt) -> tuple[list[int], str | None]:
    """(token ids, prompt text) of a prompt: a string (encoded), token ids (kept as they
    are) or chat messages, a list of {"role", "content"} dicts (content a string or OpenAI's
    text parts: `template_message`; rendered with the model's chat template, then encoded). The text is the string given, else None. Without a
    tokenizer only token ids are a prompt. (LLMEngine.tokenize, the one place prompts
    become tokens, calls this.)"""
    if hasattr(prompt, "tolist") and not isinstance(prompt, str):   # a tensor or array of token ids
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                 for t in prompt):
        return [int(t) for t in prompt], None   # (numpy's integers too)
    is_messages = isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt)
    if not (isinstance(prompt, str) or is_messages):
        raise ValueError('prompt must be a string, a list of token ids, or chat messages '
                         '(a list of {"role", "content"} dicts)')
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer; pass the prompt as token ids")
    if isinstance(prompt, str):
        try:
            return tokenizer.encode(prompt), prompt
        except (TypeError, UnicodeError) as err:   # a lone surrogate ("\ud800") is no UTF-8
            raise ValueError(f"prompt cannot be encoded: {err}") from None
    from jinja2 import TemplateError   # chat templates are Jinja templates

    messages = [template_message(m) for m in prompt]
    try:
        return tokenizer.apply_chat_template(messages), None
    except TemplateError as err:   # e.g. a template that only allows alternating roles
        raise ValueError(f"chat template: {err}") from None
    except (TypeError, UnicodeError) as err:   # e.g. a content that is no string
        raise ValueError(f"chat messages cannot be encoded: {err}") from None


class IncrementalDetokenizer:
    """Decodes a growing list of output tokens into text, one token at a time.

    It decodes a short window of tokens twice (with and without the newest ones) and
    returns only the difference; a window ending in an incomplete UTF-8 character
    (decoded as U+FFFD) waits for the next token. Work per token does not grow with the
    output's length. What of the text is shown, and stop strings, are the output
    processor's (engine/output.py: OutputText).
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


def check_prompt_ids(token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt's token ids are usable: not empty, in the vocabulary, and leaving room in
    the context for at least one new token (ContextLengthError otherwise)."""
    if not token_ids:
        raise ValueError("prompt is empty")
    if any(t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ContextLengthError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                                 f"{max_model_len} (the prompt and at least one new token must fit)")
