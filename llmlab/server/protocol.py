"""The OpenAI wire format of requests: bodies (validated by pydantic) and errors.

Field names and shapes follow the OpenAI API reference (and vLLM's extensions `top_k`,
`min_p`, `ignore_eos`, `stop_token_ids`, `priority` and `stream_options.continuous_usage_stats`), so the official `openai`
client and tools built on it (lm-evaluation-harness, GuideLLM) work unchanged. A completion's
`prompt` takes all four of OpenAI's forms (a string, a list of strings, a list of token ids,
a list of token-id lists); `n` completions of each prompt; `logprobs` (completions: k, up to
20 as in vLLM, where OpenAI stops at 5; chat: `logprobs: true` and `top_logprobs` k, up to
20) and `echo` (completions: the prompt, and its tokens' logprobs, before the completion;
with `max_tokens: 0` the prompt alone, as vLLM does).
A body is parsed and validated in one pass by pydantic's own JSON parser
(`model_validate_json`): it refuses what Python's `json` module would let through to
crash later (lone surrogates like "\\ud800", nesting thousands deep, 5,000-digit numbers,
`Infinity` and `NaN`), and every error names the field it is about, as a path into the body
(`messages[1].content[0].type`). Types are strict (the string "5" is not a number, as in
OpenAI's own API), and null is a field's default (OpenAI marks them nullable); values are
checked once, by `SamplingParams`.

Fields this server does not act on come in two kinds. Those that ask for a different output
(a tool or function call, audio, a web search, JSON, penalties, `best_of` other than `n`,
and vLLM's `repetition_penalty`, `min_tokens`, guided decoding, beam search, chat-template
controls, ...) are a 400 naming the field unless they are at their "off" value: a client that
asked for audio, or for JSON matching a schema, and got plain text could not tell. The rest (bookkeeping and hints: `store`, `metadata`, `service_tier`,
`user`, `parallel_tool_calls`, `reasoning_effort`, a message's `name`, and any field
OpenAI may add) are accepted and listed by `ignored_fields`, which the server logs in one
warning line per request, as vLLM does.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from llmlab.model.tokenizer import template_message
from llmlab.sampling import SamplingParams


class APIError(Exception):
    """An error the client gets as OpenAI's JSON error object, with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def shutting_down() -> APIError:
    """What a request gets that the server will not run because it is going away."""
    return APIError(503, "the server is shutting down; retry on another replica or later", type="server_error")


# OpenAI fields this server does not implement, accepted only at their "off" value (or
# null), so a client that relies on one gets a clear 400 instead of different behaviour.
# `()`: no value is off.
UNSUPPORTED_FIELDS = {
    "suffix": ("",), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
    "functions": ([],), "function_call": ("none",),        # the tools API before `tools`
    "modalities": (["text"],), "audio": (), "web_search_options": (),
    "prediction": (),    # a predicted output: the client expects it reused and its tokens counted
    "prompt_logprobs": (),   # vLLM's: the prompt's logprobs in a shape of its own (echo + logprobs gives them)
    # vLLM's sampling and decoding extensions that change the output and are not implemented here
    "repetition_penalty": (1,), "min_tokens": (0,), "use_beam_search": (False,), "length_penalty": (1,),
    "bad_words": ([],), "allowed_token_ids": (), "logits_processors": (), "truncate_prompt_tokens": (),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "return_tokens_as_token_ids": (False,),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "guided_whitespace_pattern": (), "structured_outputs": (), "prompt_embeds": (),
}
# chat has no `echo` in OpenAI's API (vLLM's echoes the last message; not here), and vLLM's chat
# template controls: the model's own template, one assistant turn opened after the messages
CHAT_UNSUPPORTED_FIELDS = {**UNSUPPORTED_FIELDS, "echo": (False,), "add_generation_prompt": (True,),
                           "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},),
                           "documents": ()}
# in a message: an assistant turn that called tools (the template here has no way to write it)
UNSUPPORTED_MESSAGE_FIELDS = {"tool_calls": ([],), "function_call": ()}


# strict types, no Infinity/NaN; unknown top-level fields are ignored (as vLLM does)
STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def is_off(value, off: tuple) -> bool:
    """Whether `value` is one of a field's off values, a boolean only where the off value is
    one (Python has True == 1 and False == 0: best_of true is not best_of 1)."""
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


MAX_CHOICES = 1024   # prompts x n in one request (a 1 MiB body could list 250,000 one-token prompts)
# echo with logprobs: every choice scores its prompt's tokens again (a request that asks for them
# finds nothing in the prefix cache) and sends (1 + k) entries for each: prompt tokens x n x
# (1 + k) in one request is bounded, else a 10 KB body costs a minute of the engine and 14 MB
# of answer, and a 1 MiB one hundreds of times that
MAX_ECHO_LOGPROBS = 1 << 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")   # a typo here is a 400, as in OpenAI
    include_usage: bool = False
    include_obfuscation: bool = True   # OpenAI pads chunks against length side channels; accepted, unused
    # vLLM's: usage (the choice's prompt tokens, its completion tokens so far) on every chunk;
    # GuideLLM asks for it. Works with or without include_usage (vLLM wants both).
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share."""
    model_config = STRICT

    model: str | None = None        # OpenAI requires it; curl users may leave it out
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # vLLM extension
    min_p: float = 0.0              # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None   # vLLM extension: end a completion at any of these tokens
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False        # vLLM extension: benchmarks use it for exact output lengths
    priority: int = 0               # vLLM extension: for `llmlab serve --policy priority`, lower first
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)
    unsupported_fields: ClassVar[dict] = UNSUPPORTED_FIELDS
    logprobs_param: ClassVar[str] = "logprobs"    # the field that sets k (chat: top_logprobs)

    @model_validator(mode="before")
    @classmethod
    def reject_unsupported(cls, data):
        if isinstance(data, dict):
            # null is the default (OpenAI marks these fields nullable; clients send None for unset)
            data = {name: value for name, value in data.items()
                    if not (value is None and name in cls.model_fields and cls.model_fields[name].default is not None)}
            refuse_unsupported(data, cls.unsupported_fields)
            # best_of: the best of k sampled completions (by their logprob); k = n is all of them
            best_of, n = data.get("best_of"), data.get("n", 1)
            if best_of is not None and (isinstance(best_of, bool) or best_of != n):
                raise APIError(400, "'best_of' is not supported by this server (only best_of = n, which returns "
                               "every completion)", param="best_of", code="unsupported_parameter")
        return data

    @model_validator(mode="wrap")
    @classmethod
    def note_ignored_fields(cls, data, handler):
        request = handler(data)
        if isinstance(data, dict):
            request._ignored_fields = ignored_fields(cls, data)
        return request

    @property
    def ignored_fields(self) -> list[str]:
        """The fields the request set (not null) that this server accepted but does not act
        on, with a message's as `messages[i].name`."""
        return self._ignored_fields

    @model_validator(mode="after")
    def stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true",
                           param="stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    # (subclasses say what they ask of logprobs and echo)
    @property
    def num_logprobs(self) -> int | None:
        """k alternatives per token when the request asks for logprobs, else None."""
        return None

    @property
    def echo_prompt(self) -> bool:
        return False

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the max_tokens asked for or None, the field that asked)."""
        return self.max_tokens, "max_tokens"

    @property
    def prompt_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the prompt's scores alone (vLLM's answer to it). The
        engine generates at least one token: it runs one, and the answer leaves it out."""
        return self.echo_prompt and self.requested_max_tokens[0] == 0

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams (n of them: `fan_out`); `max_tokens` overrides the
        requested one (the server resolves the default once it knows the prompt's length)."""
        requested, param = self.requested_max_tokens
        k = self.num_logprobs
        fields = dict(max_tokens=requested if max_tokens is None else max_tokens, temperature=self.temperature,
                      top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                      stop=[] if self.stop is None else self.stop,   # "" is refused, as [""] is
                      stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, priority=self.priority, n=self.n, logprobs=k,
                      prompt_logprobs=k if self.echo_prompt else None)
        if fields["max_tokens"] is None or self.prompt_only:
            # None: only checking the other fields, before the prompt is known; prompt_only: one token is run
            fields["max_tokens"] = 1
        try:
            return SamplingParams(**fields)
        except ValueError as err:
            field = refused_field(fields)
            names = {"max_tokens": param, "logprobs": self.logprobs_param, "prompt_logprobs": self.logprobs_param}
            name = names.get(field, field)     # the request's name for it
            raise APIError(400, str(err).replace(f"SamplingParams.{field}", f"'{name}'"), param=name) from None


def refuse_unsupported(data: dict, unsupported: dict, prefix: str = "") -> None:
    """A 400 for the first field of `unsupported` that `data` sets to a value that is not off."""
    for name, off in unsupported.items():
        if data.get(name) is not None and not is_off(data[name], off):
            raise APIError(400, f"'{prefix}{name}' is not supported by this server", param=prefix + name,
                           code="unsupported_parameter")


def ignored_fields(model: type[BaseModel], data: dict) -> list[str]:
    """Fields of a request body (a dict) that `model` neither declares nor refuses, and that
    are not null: accepted, not acted on. A message's are named `messages[i].<field>`."""
    def unused(fields: dict, declared, unsupported) -> list[str]:
        return [name for name, value in fields.items()
                if value is not None and name not in declared and name not in unsupported]
    names = unused(data, model.model_fields, model.unsupported_fields)
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):
            names += [f"messages[{i}].{name}"
                      for name in unused(message, ChatMessage.model_fields, UNSUPPORTED_MESSAGE_FIELDS)]
    return names


def refused_field(fields: dict) -> str | None:
    """The field SamplingParams refuses: the first one that fails on its own (each check
    looks at one field), so the error names it without parsing the message."""
    for name, value in fields.items():
        try:
            SamplingParams(**{name: value})
        except ValueError:
            return name
    return None


def resolve_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int,
                       max_model_len: int, param: str, prompt_param: str, prompt_name: str = "the prompt") -> int:
    """Output tokens the request may generate. A `max_tokens` the context cannot hold is
    a 400 (OpenAI and vLLM refuse it; clamping it would silently shorten the answer);
    without one, `default` (or the rest of the context) is cut to what fits. (`max_tokens: 0`
    with echo runs one token: 1 here.)"""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, "
                       f"but {prompt_name} has {num_prompt_tokens} (the prompt and at least one new "
                       f"token must fit)", param=prompt_param, code="context_length_exceeded")
    if requested == 0:
        return 1
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"'{param}' is too large: {requested}. This model's maximum context "
                       f"length is {max_model_len} tokens and {prompt_name} has {num_prompt_tokens} "
                       f"({requested} > {max_model_len} - {num_prompt_tokens})",
                       param=param, code="context_length_exceeded")
    return requested


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None     # k: the sampled token's logprob and the k most likely (0..20)
    echo: bool = False              # the prompt before the completion (and its logprobs first)
    best_of: int | None = None      # only = n (checked in reject_unsupported)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_prompt(self) -> bool:
        return self.echo

    def check_echo_logprobs(self, prompt_lengths: list[int]) -> None:
        """A 400 when echo's prompt logprobs would pass MAX_ECHO_LOGPROBS entries."""
        if not self.echo or self.logprobs is None:
            return
        entries = sum(prompt_lengths) * self.n * (1 + self.logprobs)
        if entries > MAX_ECHO_LOGPROBS:
            raise APIError(400, f"echo with logprobs scores every prompt token for every choice: {sum(prompt_lengths)} "
                           f"prompt tokens x n = {self.n} x (1 + logprobs = {self.logprobs}) is {entries} entries, more "
                           f"than {MAX_ECHO_LOGPROBS}; ask for fewer choices or alternatives, or split the prompts",
                           param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids: a list of strings or of token-id lists is
        several (one choice each, times n); a string or a list of token ids is one."""
        prompt = self.prompt
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(400, f"too many completions in one request: {len(prompts)} prompts x n = {self.n} is "
                           f"{len(prompts) * self.n}, more than {MAX_CHOICES}; split it into several requests",
                           param="n" if len(prompts) == 1 else "prompt")
        return prompts


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None   # null only for an assistant (OpenAI: a tool-call turn)

    @model_validator(mode="after")
    def content_needed(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def as_template_message(self) -> dict:
        """{"role", "content"} as chat templates expect it (text parts joined: the tokenizer's
        `template_message`, which LLM.chat's messages go through too)."""
        return template_message(self.model_dump(include={"role", "content"}))


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens
    logprobs: bool = False          # each output token's logprob ...
    top_logprobs: int | None = None  # ... and the k most likely there (0..20; needs logprobs: true)
    unsupported_fields: ClassVar[dict] = CHAT_UNSUPPORTED_FIELDS
    logprobs_param: ClassVar[str] = "top_logprobs"

    @model_validator(mode="after")
    def top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="before")
    @classmethod
    def reject_unsupported_in_messages(cls, data):
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            for i, message in enumerate(data["messages"]):
                if isinstance(message, dict):
                    refuse_unsupported(message, UNSUPPORTED_MESSAGE_FIELDS, prefix=f"messages[{i}].")
        return data

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        # the newer name wins when both are set (as vLLM and SGLang do; OpenAI deprecated max_tokens)
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt's or a conversation's token ids, as a completion or a chat
    request would use them (so `count` is its usage.prompt_tokens)."""
    model_config = STRICT
    unsupported_fields: ClassVar[dict] = {"add_special_tokens": (), "add_generation_prompt": (True,),
                                          "continue_final_message": (False,), "chat_template": (),
                                          "chat_template_kwargs": ({},), "return_token_strs": (False,)}
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="before")
    @classmethod
    def reject_unsupported(cls, data):
        if isinstance(data, dict):
            refuse_unsupported(data, cls.unsupported_fields)
        return data

    @model_validator(mode="after")
    def one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either 'prompt' or 'messages'", param="prompt" if self.prompt is None else "messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text (special tokens included, as echo shows them)."""
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


def parse_json(model: type[BaseModel], body: bytes) -> BaseModel:
    """Parse and validate a raw JSON body in one pass; a 400 naming the first bad field
    (pydantic's `loc`), or saying the body is not JSON at all. One leading UTF-8 byte order
    mark is skipped: RFC 8259 §8.1 lets parsers ignore it (Windows tools write one)."""
    try:
        return model.model_validate_json(body.removeprefix(b"\xef\xbb\xbf"))
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":   # also: not UTF-8, too deep, a number too long
            raise APIError(400, f"the request body is not valid JSON: "
                           f"{first['msg'].removeprefix('Invalid JSON: ')}") from None
        # of the errors about the first bad field, the one deepest inside it: a union (a message's
        # content: a string or a list of parts) fails on every variant, and the deepest says what
        # was wrong in the variant the client meant (messages[1].content[0].type, not "a string")
        errors = [e for e in err.errors(include_url=False) if e["loc"][:1] == first["loc"][:1]]
        first = max(errors, key=lambda e: len(request_path(e["loc"])))
        path = request_path(first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if path:
            message = f"invalid value for '{path}': {message}"
        raise APIError(400, message, param=path or None) from None


def request_path(loc: tuple) -> str:
    """A pydantic error's location as the request names it, `messages[1].content[0].text`:
    the variant names pydantic adds inside a union ('str', 'list[int]', 'function-after[...]')
    are its own, not the request's."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not any(c in part for c in "[(") and part not in {"str", "int", "float", "bool", "list", "dict"}:
            path += f".{part}" if path else part
    return path
