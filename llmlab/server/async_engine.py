"""The API side of the engine: handlers share one engine loop (engine_loop.py), which runs on
a thread of this process (an LLMEngine given: notebooks, tests) or in an engine-core process
of its own (`llmlab serve`: engine_process.py). The handlers cannot tell which.

  handler -> engine loop: a command (add a request group, abort one request) is sent to the
      loop, which runs the commands that arrived between two steps, then `engine.step()`
      while any request is unfinished, and sleeps when there is nothing to do.
  engine loop -> handler: one batch of events per step arrives on the event loop (from the
      engine thread, or the engine process's reader thread, by `loop.call_soon_threadsafe`);
      `_dispatch` rebuilds each request's RequestOutput and puts it in its request's
      asyncio.Queue, and keeps the metrics (it sees every token as it arrives).

Requests from every client meet in the same `engine.step()`, so they are batched together
(iteration-level scheduling, Orca) without the handlers knowing about each other. Because
steps run off the event loop, a slow step never delays accepting a connection.

One API request can be several engine requests: `n` completions of a prompt, and a
completion request may hold many prompts (an evaluation harness sends 8-32). The engine takes
one sequence per request, so a handler hands over all of them at once (`add_requests`): one
command, run between two steps, adds them all (they start in the same step, and `n` siblings
share the prompt's blocks through the prefix cache), or, if the engine refuses one, aborts
those it had added, so a refused request leaves nothing running. Their outputs come back
through one queue (`RequestGroup`, request_group.py).

Prompts are tokenized (and chat templates applied) on tokenizer threads, off both the
event loop and the engine, and reach the engine as token ids (tokenizer_threads.py).

If the engine loop ends without being stopped (its process died), every running request
ends with a 500, `is_running` turns False (/health: 503) and `on_engine_death` is called
(`llmlab serve` exits).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable

from llmlab.engine.engine import LLMEngine
from llmlab.sampling import SamplingParams
from llmlab.server.engine_loop import EngineThread
from llmlab.server.engine_process import EngineProcess
from llmlab.server.metrics import ServerMetrics
from llmlab.server.protocol import APIError, shutting_down
from llmlab.server.request_group import RefusedRequest, RequestGroup, RequestStream
from llmlab.server.tokenizer_threads import TokenizerLanes

logger = logging.getLogger("llmlab.server")


def engine_failed() -> APIError:    # the details go to the log, not to the client
    return APIError(500, "the engine failed while running this request", type="server_error")


def engine_not_running() -> APIError:
    return APIError(503, "the engine is not running", type="server_error")


FAILURES = {"engine_failed": engine_failed, "shutting_down": shutting_down}   # the loop's reasons


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineProcess, metrics: ServerMetrics | None = None):
        self.engine = engine
        # the loop: the engine process's, or a thread of ours driving the LLMEngine
        self.core = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
        self.kv_stats = engine.kv_stats()     # the loop's latest, refreshed with every batch
        self.metrics = metrics if metrics is not None else ServerMetrics(lambda: self.kv_stats)
        self.draining = False                 # shutting down: no new requests
        self.engine_died = False              # the loop ended without being stopped
        self.on_engine_death: Callable[[int], None] | None = None   # called with the requests it ended
        self._streams: dict[str, RequestStream] = {}   # accepted, unfinished requests
        self._groups: dict[int, RequestGroup] = {}     # sent to the engine, not yet accepted
        self._group_ids = itertools.count()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokenizer_lanes = TokenizerLanes(engine)

    def start(self) -> None:
        """Start the engine loop; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._stopping = self.draining = self.engine_died = False
        self._tokenizer_lanes.start()
        self.core.start(lambda batch: self._on_loop(self._dispatch, batch),
                        lambda: self._on_loop(self._loop_ended))

    @property
    def is_running(self) -> bool:
        return self.core.is_alive and not self.engine_died

    def stop(self) -> None:
        self._stopping = True
        self.core.stop()
        self._tokenizer_lanes.stop()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams) + len(self._groups)   # (groups: requests not yet added)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests (503), give running ones up to `timeout`
        seconds to finish, then end the rest with a 503 "shutting down" error (a stream
        sends it as its last event, then [DONE])."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.num_unfinished and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_unfinished:
            logger.warning("shutdown: ending %d unfinished requests", self.num_unfinished)
        self.core.send(("fail_all", "shutting_down"))

    async def tokenize(self, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None) -> list[int]:
        """Token ids, from a tokenizer thread (tokenizer_threads.py); ValueError for what
        cannot be tokenized, ContextLengthError for what cannot fit."""
        return await self._tokenizer_lanes.tokenize(prompt, messages)

    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Queue an API request's engine requests, (request id, token ids, params) each: choice
        i is requests[i]. The engine loop adds them in one go, between two steps. Returns
        once the engine has accepted them all; raises RefusedRequest if it refused one (the
        client's fault; none of them is left in the engine), APIError 503 while shutting down."""
        if self.draining or self._stopping:
            raise shutting_down()
        if self.engine_died:
            raise engine_not_running()
        queue = asyncio.Queue()
        streams = [RequestStream(request_id, index, token_ids, params, queue)
                   for index, (request_id, token_ids, params) in enumerate(requests)]
        group = RequestGroup(self.abort, streams, queue, self._loop.create_future())
        group_id = next(self._group_ids)
        self._groups[group_id] = group
        self.core.send(("add", group_id, requests))
        try:
            await group.accepted
        except asyncio.CancelledError:
            group.close()
            raise
        return group

    def abort(self, request_id: str) -> None:
        """Stop generating for a request and free its KV blocks (no-op once finished)."""
        self.core.send(("abort", request_id))

    # ---- what the engine loop reports (run on the event loop) ------------------------------
    def _dispatch(self, batch: tuple) -> None:
        events, self.kv_stats = batch
        now = time.perf_counter()
        for event in events:
            kind = event[0]
            if kind == "output":
                self._deliver(event[1], event[2], now)
            elif kind == "accepted":
                group = self._groups.pop(event[1])
                for stream in group.streams:
                    self._streams[stream.request_id] = stream
                    self.metrics.on_added(len(stream.prompt_token_ids))
                self._resolve(group.accepted)
            elif kind == "refused":
                self._resolve(self._groups.pop(event[1]).accepted, RefusedRequest(event[2], event[3]))
            elif kind == "add_failed":
                self._resolve(self._groups.pop(event[1]).accepted, engine_failed())
            elif kind == "failed":
                error = FAILURES[event[1]]()
                for request_id, num_preemptions in event[2]:
                    stream = self._streams.pop(request_id, None)
                    if stream is not None:
                        self.metrics.preemptions.inc(num_preemptions)
                        stream.queue.put_nowait((stream.index, error))

    def _deliver(self, request_id: str, delta, now: float) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        num_new = len(delta.delta_token_ids)
        if num_new > 0:
            first = not stream.token_ids
            self.metrics.on_tokens(num_new, now - stream.arrival_time if first else None,
                                   None if first else now - stream.last_token_time)
            stream.last_token_time = now
        output = stream.received(delta)
        if delta.finished:
            del self._streams[request_id]
            self.metrics.on_finished(delta.finish_reason, now - stream.arrival_time, delta.num_preemptions)
        stream.queue.put_nowait((stream.index, output))

    def _loop_ended(self) -> None:
        """The engine loop is gone. Stopped: nothing to do. Died: end what it was running."""
        if self._stopping:
            return
        self.engine_died = True
        error = engine_failed()
        num_ended = len(self._streams) + len(self._groups)
        for stream in self._streams.values():
            stream.queue.put_nowait((stream.index, error))
        for group in self._groups.values():
            self._resolve(group.accepted, error)
        self._streams.clear()
        self._groups.clear()
        if self.on_engine_death is not None:
            self.on_engine_death(num_ended)
        else:
            logger.error("the engine loop ended; %d requests were ended with a 500", num_ended)

    @staticmethod
    def _resolve(future: asyncio.Future, error: Exception | None = None) -> None:
        if future.done():     # the handler was cancelled meanwhile (it aborts the request)
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)

    def _on_loop(self, function, *args) -> None:
        """Run `function(*args)` on the event loop: asyncio objects are not thread-safe."""
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:    # the event loop is closed: nobody is listening any more
            pass
