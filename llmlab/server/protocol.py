"""The OpenAI wire format: request bodies (validated by pydantic), response bodies, errors.

Field names and shapes follow the OpenAI API reference (and vLLM's extensions `top_k`
and `ignore_eos`), so the official `openai` client and tools built on it work unchanged.
Values are checked once, by `SamplingParams`; pydantic only checks types (strictly: the
string "5" is not a number here, as in OpenAI's own API).
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

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


# OpenAI fields this server does not implement, accepted only at their "off" value (or
# null), so a client that relies on one gets a clear 400 instead of different behaviour.
UNSUPPORTED_FIELDS = {
    "echo": (False,), "best_of": (1,), "logprobs": (False, 0), "top_logprobs": (0,),
    "suffix": ("",), "logit_bias": ({},), "presence_penalty": (0,), "frequency_penalty": (0,),
    "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields completions and chat share. Unknown fields are ignored (as vLLM does)."""
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None        # OpenAI requires it; curl users may leave it out
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False        # vLLM extension: benchmarks use it for exact output lengths
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def reject_unsupported(cls, data):
        if isinstance(data, dict):
            for name, off in UNSUPPORTED_FIELDS.items():
                if data.get(name) is not None and data[name] not in off:
                    raise APIError(400, f"'{name}' is not supported by this server", param=name,
                                   code="unsupported_parameter")
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k, seed=self.seed, stop=self.stop or [],
                                  ignore_eos=self.ignore_eos)
        except ValueError as err:   # "SamplingParams.<field> must be ..."
            field = re.search(r"SamplingParams\.(\w+)", str(err))
            raise APIError(400, str(err), param=field.group(1) if field else None) from None


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
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict:
        """{"role", "content"} as chat templates expect it (text parts joined)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None   # OpenAI's newer name for max_tokens

    @model_validator(mode="after")
    def merge_max_tokens(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def parse(model: type[BaseModel], data) -> BaseModel:
    """Validate a decoded JSON body; type errors become a 400 naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else None
        message = first["msg"].removeprefix("Value error, ")
        if field is not None:
            message = f"invalid value for '{field}': {message}"
        raise APIError(400, message, param=field) from None


# ---- responses -----------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0      # served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> "Usage":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached_tokens))


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """Both the whole response and, with stream=true, each chunk (same object name)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def without_nulls(self) -> dict:   # OpenAI sends {"content": "..."}, and {} at the end
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]   # empty in the final usage chunk
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmlab"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
