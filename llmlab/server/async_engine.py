"""The engine loop behind the server: one thread owns the engine, many handlers share it.

`LLMEngine` is not thread-safe, so exactly one thread ever touches it: the engine thread.
Handlers run on the asyncio event loop and talk to it in two ways:

  handler -> engine thread: a command (add a request, abort one) is appended to a queue;
      the engine thread runs queued commands between steps, then `engine.step()` while any
      request is unfinished, and sleeps on an Event when there is nothing to do.
  engine thread -> handler: each request has an asyncio.Queue; outputs are put there with
      `loop.call_soon_threadsafe` (asyncio objects may only be touched from the loop).

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
event loop and the engine thread, and reach the engine as token ids (tokenizer_threads.py).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time

from llmlab.engine.engine import LLMEngine
from llmlab.request import RequestOutput
from llmlab.sampling import SamplingParams
from llmlab.server.metrics import ServerMetrics
from llmlab.server.protocol import APIError, shutting_down
from llmlab.server.request_group import RefusedRequest, RequestGroup, RequestStream
from llmlab.server.tokenizer_threads import TokenizerLanes

logger = logging.getLogger("llmlab.server")


def engine_failed() -> APIError:    # the details go to the log, not to the client
    return APIError(500, "the engine failed while running this request", type="server_error")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.kv_stats = engine.kv_stats()     # refreshed by the engine thread after every step
        self.metrics = metrics if metrics is not None else ServerMetrics(lambda: self.kv_stats)
        self.draining = False                 # shutting down: no new requests
        self._commands = collections.deque()  # functions the engine thread runs between steps
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}   # unfinished requests (written by the engine thread)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tokenizer_lanes = TokenizerLanes(engine)

    # ---- the event loop's side -----------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._stopping = self.draining = False
        self._tokenizer_lanes.start()
        self._thread = threading.Thread(target=self._run, name="llmlab-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._tokenizer_lanes.stop()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams) + len(self._commands)   # (commands: requests not yet added)

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
        self._call_soon(self._fail_all, shutting_down())

    async def tokenize(self, prompt: str | list[int] | None = None,
                       messages: list[dict] | None = None) -> list[int]:
        """Token ids, from a tokenizer thread (tokenizer_threads.py); ValueError for what
        cannot be tokenized, ContextLengthError for what cannot fit."""
        return await self._tokenizer_lanes.tokenize(prompt, messages)

    async def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Queue an API request's engine requests, (request id, token ids, params) each: choice
        i is requests[i]. The engine thread adds them in one go, between two steps. Returns
        once the engine has accepted them all; raises RefusedRequest if it refused one (the
        client's fault; none of them is left in the engine), APIError 503 while shutting down."""
        if self.draining or self._stopping:
            raise shutting_down()
        queue = asyncio.Queue()
        streams = [RequestStream(request_id, index, token_ids, params, queue)
                   for index, (request_id, token_ids, params) in enumerate(requests)]
        group = RequestGroup(self.abort, streams, queue, self._loop.create_future())
        self._call_soon(self._add, group)
        try:
            await group.accepted
        except asyncio.CancelledError:
            group.close()
            raise
        return group

    def abort(self, request_id: str) -> None:
        """Stop generating for a request and free its KV blocks (no-op once finished)."""
        self._call_soon(self._abort, request_id)

    def _call_soon(self, function, *args) -> None:
        self._commands.append((function, args))   # deque.append is thread-safe
        self._wakeup.set()

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wakeup.clear()    # before reading commands, so none can be missed
            while self._commands:
                function, args = self._commands.popleft()
                try:
                    function(*args)
                except Exception:   # keep the loop alive whatever one command does
                    logger.exception("engine command %s%s failed", function.__name__, args)
            if self._stopping:
                break
            if not self.engine.has_unfinished_requests():
                self.kv_stats = self.engine.kv_stats()
                self._wakeup.wait()     # idle: sleep until a command arrives
                continue
            try:
                outputs = self.engine.step()
            except Exception:    # a bug in the engine: fail its requests, keep serving
                logger.exception("engine.step() failed; aborting %d requests", len(self._streams))
                self._fail_all(engine_failed())
                continue
            now = time.perf_counter()
            for output in outputs:
                self._deliver(output, now)
            self.kv_stats = self.engine.kv_stats()
        self._fail_all(shutting_down())

    def _add(self, group: RequestGroup) -> None:
        """Add every engine request of the group, or none: one the engine refuses aborts
        those added before it (they have not run a step yet)."""
        if self._stopping:    # queued before a shutdown ended the others
            self._resolve(group.accepted, error=shutting_down())
            return
        added = []
        for stream in group.streams:
            try:
                self.engine.add_request(stream.prompt_token_ids, stream.params, stream.request_id)
            except Exception as err:
                for other in added:
                    self.engine.abort(other.request_id)
                if isinstance(err, ValueError):     # the client's fault: a 400
                    self._resolve(group.accepted, error=RefusedRequest(stream.index, err))
                else:
                    logger.exception("adding request %s failed", stream.request_id)
                    self._resolve(group.accepted, error=engine_failed())
                return
            added.append(stream)
        for stream in group.streams:
            stream.request = self.engine.requests.get(stream.request_id)
            self._streams[stream.request_id] = stream
            self.metrics.on_added(len(stream.prompt_token_ids))
        self._resolve(group.accepted)

    def _finished(self, stream: RequestStream, finish_reason: str, now: float) -> None:
        num_preemptions = stream.request.num_preemptions if stream.request is not None else 0
        self.metrics.on_finished(finish_reason, now - stream.arrival_time, num_preemptions)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            request = self.engine.requests.get(request_id)
            self.engine.abort(request_id)
            self._finished(stream, "abort", time.perf_counter())
            if request is not None:   # a reader still iterating outputs() gets the end: finish_reason "abort"
                self._put(stream, RequestOutput.of(request))

    def _deliver(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        num_new = len(output.delta_token_ids)
        if num_new > 0:
            first = stream.num_tokens_seen == 0
            self.metrics.on_tokens(num_new, now - stream.arrival_time if first else None,
                                   None if first else now - stream.last_token_time)
            stream.num_tokens_seen, stream.last_token_time = stream.num_tokens_seen + num_new, now
        if output.finished:
            del self._streams[output.request_id]
            self._finished(stream, output.finish_reason, now)
        self._put(stream, output)

    def _fail_all(self, err: APIError) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            if stream.request is not None and stream.request.num_preemptions:
                self.metrics.preemptions.inc(stream.request.num_preemptions)
            self._put(stream, err)
        self._streams.clear()

    def _resolve(self, future: asyncio.Future, error: Exception | None = None) -> None:
        def resolve():
            if future.done():     # the handler was cancelled meanwhile (it aborts the request)
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)
        self._on_loop(resolve)

    def _put(self, stream: RequestStream, item) -> None:
        self._on_loop(stream.queue.put_nowait, (stream.index, item))

    def _on_loop(self, function, *args) -> None:
        """Run `function(*args)` on the event loop: asyncio objects are not thread-safe."""
        try:
            self._loop.call_soon_threadsafe(function, *args)
        except RuntimeError:    # the event loop is closed: nobody is listening any more
            pass
