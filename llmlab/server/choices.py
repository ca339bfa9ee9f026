"""From engine outputs to an answer's choices: what each choice shows (text, echo, logprobs),
its `index`, and the usage of the whole answer.

An API request is one engine request per choice: choice `prompt_index * n + i` is the i-th
of the `n` completions of prompt `prompt_index` (`SamplingParams.fan_out`: seeds seed,
seed + 1, ...). `CompletionChoices` and `ChatChoices` build the same choice from a stream's
deltas (one chunk per output, a stream's chunks adding up to the whole answer) and from a
finished output (the whole answer), with one method each, so the two cannot differ.

Usage sums over the answer: prompt tokens once per prompt (not once per choice), completion
tokens over every choice, cached tokens per prompt as its least-cached choice found them (its
`n` siblings find the prompt's blocks through each other). `continuous_usage_stats` (vLLM's)
puts on every chunk the usage of that chunk's choice so far.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmlab.request import RequestOutput
from llmlab.server.request_group import RequestGroup, RequestStream
from llmlab.server.logprobs import CompletionLogprobs, TokenNames, chat_logprobs
from llmlab.server.responses import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                     ChatMessageOut, Completion, CompletionChoice, Delta, Usage)


@dataclass
class ChoiceState:
    """What the reader knows of one choice."""
    started: bool = False        # its first piece went out (with echo: the prompt)
    num_tokens: int = 0          # completion tokens so far
    num_cached: int = 0          # prompt tokens its engine request found in the prefix cache
    logprobs: CompletionLogprobs | None = None
    outputs: list = field(default_factory=list)


class Choices:
    """What both endpoints share: the answer's id, the choices' states, usage."""

    def __init__(self, response_id: str, created: int, model: str, body, group: RequestGroup, names: TokenNames):
        self.response_id, self.created, self.model, self.body, self.group = response_id, created, model, body, group
        self.names = names
        self.num_logprobs = body.num_logprobs          # None: no logprobs asked
        self.continuous_usage = body.stream and body.continuous_usage
        self.states = [ChoiceState(logprobs=CompletionLogprobs(names)) for _ in group.streams]

    def advance(self, stream: RequestStream, output: RequestOutput, token_ids: list[int]) -> ChoiceState:
        state = self.states[stream.index]
        state.num_tokens += len(token_ids)
        state.num_cached = output.num_cached_prompt_tokens
        return state

    def choice_usage(self, stream: RequestStream) -> Usage | None:
        """The chunk's usage under continuous_usage_stats: its choice's, so far."""
        if not self.continuous_usage:
            return None
        return Usage.of(len(stream.prompt_token_ids), self.states[stream.index].num_tokens)

    def usage(self) -> Usage:
        n, streams = self.body.n, self.group.streams
        prompts = range(0, len(streams), n)      # each prompt's first choice
        return Usage.of(sum(len(streams[first].prompt_token_ids) for first in prompts),
                        sum(state.num_tokens for state in self.states),
                        sum(min(state.num_cached for state in self.states[first:first + n]) for first in prompts))

    def finals(self, outputs: dict[int, RequestOutput]) -> list:
        """The whole answer's choices, from each choice's finished output, in index order."""
        found = []
        for stream in self.group.streams:
            output = outputs[stream.index]
            found.append(self.choice(stream, output, output.text, output.token_ids, output.logprobs))
        return found


class CompletionChoices(Choices):
    """/v1/completions: text (after the prompt, with echo), legacy logprobs."""

    def __init__(self, *args, prompt_texts: list[str]):
        super().__init__(*args)
        self.prompt_texts = prompt_texts      # one per prompt, for echo

    def choice(self, stream: RequestStream, output: RequestOutput, text: str, token_ids: list, entries) -> CompletionChoice:
        """The choice for this much of the output: a delta (stream) or all of it."""
        body = self.body
        if body.prompt_only:     # the one token run for max_tokens 0 is not part of the answer
            text, token_ids, entries = "", [], []
        state = self.advance(stream, output, token_ids)
        if body.echo and not state.started:      # the prompt comes first, once
            text = self.prompt_texts[stream.index // body.n] + text
            if self.num_logprobs is not None:
                token_ids = stream.prompt_token_ids + list(token_ids)
                entries = list(output.prompt_logprobs) + list(entries)
        state.started = True
        logprobs = state.logprobs.piece(token_ids, entries) if self.num_logprobs is not None else None
        return CompletionChoice(index=stream.index, text=text, logprobs=logprobs,
                                finish_reason=output.finish_reason if output.finished else None)

    def chunk(self, stream: RequestStream, output: RequestOutput) -> Completion | None:
        """One streamed chunk for a choice's new output; None when it has nothing to say."""
        first = not self.states[stream.index].started
        choice = self.choice(stream, output, output.delta_text, output.delta_token_ids, output.delta_logprobs)
        if not (choice.text or choice.finish_reason or (choice.logprobs and choice.logprobs["tokens"])
                or (first and self.body.echo)):
            return None
        return self.completion([choice], self.choice_usage(stream))

    def completion(self, choices: list[CompletionChoice], usage: Usage | None = None) -> Completion:
        """Both the whole response and, streamed, each chunk (OpenAI uses one object for both)."""
        return Completion(id=self.response_id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self) -> list:
        return []

    def usage_chunk(self) -> Completion:
        return self.completion([], self.usage())

    def whole(self, outputs: dict[int, RequestOutput]) -> Completion:
        return self.completion(self.finals(outputs), self.usage())


class ChatChoices(Choices):
    """/v1/chat/completions: an assistant message, chat logprobs."""

    def choice(self, stream: RequestStream, output: RequestOutput, text: str, token_ids: list, entries) -> ChatChoice:
        self.advance(stream, output, token_ids)
        return ChatChoice(index=stream.index, message=ChatMessageOut(content=text),
                          logprobs=chat_logprobs(entries, self.names) if self.num_logprobs is not None else None,
                          finish_reason=output.finish_reason if output.finished else None)

    def chunk(self, stream: RequestStream, output: RequestOutput) -> ChatCompletionChunk | None:
        choice = self.choice(stream, output, output.delta_text, output.delta_token_ids, output.delta_logprobs)
        if not (choice.message.content or choice.finish_reason or (choice.logprobs and choice.logprobs["content"])):
            return None
        delta = Delta(content=choice.message.content or None)
        return self.chat_chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=choice.logprobs,
                                                finish_reason=choice.finish_reason)], self.choice_usage(stream))

    def chat_chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def opening(self) -> list[ChatCompletionChunk]:
        """A chunk per choice that names the speaker, before any text (as OpenAI does)."""
        return [self.chat_chunk([ChatChunkChoice(index=stream.index, delta=Delta(role="assistant", content=""))],
                                self.choice_usage(stream)) for stream in self.group.streams]

    def usage_chunk(self) -> ChatCompletionChunk:
        return self.chat_chunk([], self.usage())

    def whole(self, outputs: dict[int, RequestOutput]) -> ChatCompletion:
        return ChatCompletion(id=self.response_id, created=self.created, model=self.model,
                              choices=self.finals(outputs), usage=self.usage())
