"""The OpenAI wire format of requests: bodies (validated by pydantic) and errors.

Field names and shapes follow the OpenAI API reference (and vLLM's extensions `top_k`,
`min_p` and `ignore_eos`), so the official `openai` client and tools built on it work unchanged.
A body is parsed and validated in one pass by pydantic's own JSON parser
(`model_validate_json`): it refuses what Python's `json` module would let through to
crash later (lone surrogates like "\\ud800", nesting thousands deep, 5,000-digit numbers,
`Infinity` and `NaN`), and every error names the field it is about (`loc`). Types are
strict (the string "5" is not a number, as in OpenAI's own API); values are checked once,
by `SamplingParams`.

Fields this server does not act on come in two kinds. Those that ask for a different output
(a tool or function call, audio, a web search, JSON, logprobs, ...) are a 400 naming the
field unless they are at their "off" value: a client that asked for audio and got plain
text could not tell. The rest (bookkeeping and hints: `store`, `metadata`, `service_tier`,
`user`, `parallel_tool_calls`, `reasoning_effort`, a message's `name`, and any field
OpenAI may add) are accepted and listed by `ignored_fields`, which the server logs in one
warning line per request, as vLLM does.
"""
from __future__ import annotations

from typing import Literal

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
    # (completions' logprobs: 0 still asks for the sampled tokens' logprobs: only false is off)
    "echo": (False,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,),
    "suffix": ("",), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
    "functions": ([],), "function_call": ("none",),        # the tools API before `tools`
    "modalities": (["text"],), "audio": (), "web_search_options": (),
    "prediction": (),    # a predicted output: the client expects it reused and its tokens counted
}
# in a message: an assistant turn that called tools (the template here has no way to write it)
UNSUPPORTED_MESSAGE_FIELDS = {"tool_calls": ([],), "function_call": ()}


# strict types, no Infinity/NaN; unknown top-level fields are ignored (as vLLM does)
STRICT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def is_off(value, off: tuple) -> bool:
    """Whether `value` is one of a field's off values, a boolean only where the off value is
    one (Python has True == 1 and False == 0: best_of true is not best_of 1)."""
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")   # a typo here is a 400, as in OpenAI
    include_usage: bool = False
    include_obfuscation: bool = True   # OpenAI pads chunks against length side channels; accepted, unused


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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False        # vLLM extension: benchmarks use it for exact output lengths
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def reject_unsupported(cls, data):
        if isinstance(data, dict):
            refuse_unsupported(data, UNSUPPORTED_FIELDS)
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
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the max_tokens asked for or None, the field that asked)."""
        return self.max_tokens, "max_tokens"

    def sampling_params(self, max_tokens: int | None = None) -> SamplingParams:
        """The request's SamplingParams; `max_tokens` overrides the requested one (the
        server resolves the default once it knows the prompt's length)."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        requested, param = self.requested_max_tokens
        fields = dict(max_tokens=requested if max_tokens is None else max_tokens, temperature=self.temperature,
                      top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
                      stop=[] if self.stop is None else self.stop,   # "" is refused, as [""] is
                      ignore_eos=self.ignore_eos)
        if fields["max_tokens"] is None:
            fields["max_tokens"] = 1    # (only checking the other fields, before the prompt is known)
        try:
            return SamplingParams(**fields)
        except ValueError as err:
            field = refused_field(fields)
            name = param if field == "max_tokens" else field     # the request's name for it
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
    names = unused(data, model.model_fields, UNSUPPORTED_FIELDS)
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
                       max_model_len: int, param: str, prompt_param: str) -> int:
    """Output tokens the request may generate. A `max_tokens` the context cannot hold is
    a 400 (OpenAI and vLLM refuse it; clamping it would silently shorten the answer);
    without one, `default` (or the rest of the context) is cut to what fits."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens, "
                       f"but the prompt has {num_prompt_tokens} (the prompt and at least one new "
                       f"token must fit)", param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"'{param}' is too large: {requested}. This model's maximum context "
                       f"length is {max_model_len} tokens and the prompt has {num_prompt_tokens} "
                       f"({requested} > {max_model_len} - {num_prompt_tokens})",
                       param=param, code="context_length_exceeded")
    return requested


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several is not supported."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        return prompt


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
        if self.max_tokens is None and self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


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
        field = str(first["loc"][0]) if first["loc"] else None
        message = first["msg"].removeprefix("Value error, ")
        if field is not None:
            message = f"invalid value for '{field}': {message}"
        raise APIError(400, message, param=field) from None
