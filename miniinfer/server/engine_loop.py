"""The one thread that steps the engine. HTTP handlers run on the asyncio event loop and never
touch the engine: they put commands (add, abort) on a queue and read their request's updates
from an ``asyncio.Queue`` that this thread fills after each step.

Why a thread and not an asyncio task: a step is a forward pass that holds the CPU (or waits on
the GPU) for milliseconds to seconds; on the event loop it would freeze every connection for
that long. In a thread, PyTorch releases the GIL inside its kernels, so the event loop keeps
accepting requests and writing tokens to sockets while the next step runs.

When the engine can no longer serve (a tensor-parallel rank died, or the thread itself died on
an error no request can be blamed for), the loop says so once and for all: ``failure`` holds
the reason, every request in flight or still coming gets a 503, and ``on_failure`` tells the
server (which answers ``/health`` with a 503 and exits non-zero so that a supervisor restarts
it). An idle tensor-parallel engine probes its ranks every ``LIVENESS_PROBE_S``, so a rank that
dies between requests is noticed without waiting for the next request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.errors import MiniInferError
from ..core.kv_cache import RequestId
from ..core.openmp import release_openmp_threads
from ..core.sampling import SamplingParams, TokenLogprobs
from ..core.scheduler import FinishReason, Request
from ..engines.continuous import ContinuousEngine, StepResult
from .metrics import ServerMetrics
from .protocol import APIError

logger = logging.getLogger("miniinfer.server")

LIVENESS_PROBE_S = 1.0  # an idle engine with worker processes checks them this often


@dataclass(slots=True)
class Update:
    """What one step did for one choice of a request: its new tokens (and their logprobs, if
    asked for), and how it ended if it did."""

    index: int  # the choice (RequestHandle.index)
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: APIError | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0


@dataclass(slots=True, eq=False)
class RequestHandle:
    """The handler's side of one engine request (one choice of an HTTP request). The choices
    of one HTTP request share ``updates``; each update says whose it is."""

    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...]
    event_loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    index: int = 0
    # Another choice of the same prompt: with a prefix cache, this one is added once that one
    # has computed the prompt, and finds the prompt's full blocks cached (n > 1 shares them).
    after: RequestId | None = None
    arrival: float = field(default_factory=time.perf_counter)
    num_pushed: int = 0  # output tokens handed over so far (engine thread only)

    def push(self, update: Update) -> None:
        """From the engine thread: an asyncio.Queue is not thread-safe, so the put runs on
        the event loop."""
        self.event_loop.call_soon_threadsafe(self.updates.put_nowait, update)


def _put_all(updates: list[tuple[RequestHandle, Update]]) -> None:
    for handle, update in updates:
        handle.updates.put_nowait(update)


def _is_fatal(exc: BaseException) -> bool:
    """An error after which no step can succeed: a tensor-parallel group that lost a rank is
    shut down for good (its forward says so on every later call)."""
    from ..runner.tensor_parallel import RankFailure

    return isinstance(exc, RankFailure) or not isinstance(exc, Exception)


_STOP = object()  # commands besides a RequestHandle (add) and a RequestId (abort)
_ABORT_ALL = object()


class EngineLoop:
    """Owns the engine. ``submit`` and ``abort`` may be called from any thread; everything
    else runs on the loop's own thread."""

    def __init__(self, engine: ContinuousEngine, metrics: ServerMetrics,
                 max_waiting: int, arrival_window_s: float = 0.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.arrival_window_s = arrival_window_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[RequestId, RequestHandle] = {}  # in the engine (loop thread only)
        # Choices waiting for their first sibling's prompt (RequestHandle.after), by its id.
        self._deferred: dict[RequestId, list[RequestHandle]] = {}
        self._num_deferred = 0
        self._defer = engine is not None and engine.config.prefix_caching
        # Requests submitted but not yet taken off the command queue: two counters, each
        # written by one thread only, so no lock is needed for their difference.
        self._num_submitted = 0
        self._num_taken = 0
        # What raises once the runner has lost a process it needs (a tensor-parallel group).
        self._probe = engine.runner.check_alive if engine is not None and \
            engine.config.tensor_parallel > 1 else None
        # Why the engine can no longer serve (None while it can); written once, by the loop
        # thread. ``on_failure`` is called with it, on that thread.
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self._stopping = False
        self._unapplied: list = []
        self._thread = threading.Thread(target=self._run, name="miniinfer-engine-loop",
                                        daemon=True)

    # -- any thread -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return (self._num_submitted - self._num_taken + self._num_deferred
                + len(self.engine.scheduler.waiting))

    def health(self) -> str | None:
        """None when the engine can serve; else why not."""
        if self.failure is not None:
            return self.failure
        if self._thread.ident is not None and not self._thread.is_alive() \
                and not self._stopping:
            return "the engine loop's thread is not running"
        return None

    def start(self) -> None:
        # The calling thread loaded the model and built the engine: its OpenMP team would
        # make the loop thread's sleep between parallel regions (core.openmp).
        release_openmp_threads()
        self._thread.start()

    def submit(self, handles: Sequence[RequestHandle]) -> None:
        """Queue the choices of one request, or refuse them all with a 429 when
        ``max_waiting`` are already waiting: backpressure, instead of a queue that grows until
        memory runs out."""
        if self.failure is not None:
            raise dead_engine_error(self.failure)
        if self.num_waiting >= self.max_waiting:
            raise APIError(429, f"the server is at capacity: {self.num_waiting} requests are "
                           f"waiting (--max-waiting {self.max_waiting}); retry later",
                           "rate_limit_error", code="queue_full")
        self._num_submitted += len(handles)
        for handle in handles:
            self._commands.put(handle)

    def abort(self, request_id: RequestId) -> None:
        self._commands.put(request_id)

    def stop(self, timeout: float | None = None) -> None:
        """Abort whatever is in flight and end the thread."""
        self._stopping = True
        self._commands.put(_STOP)
        self._thread.join(timeout)

    def abort_all(self) -> None:
        """Shutting down: every request in flight ends with a 503."""
        self._commands.put(_ABORT_ALL)

    # -- the loop thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the engine is done
            logger.exception("the engine loop failed; the engine can no longer serve")
            self._die(f"{type(exc).__name__}: {exc}".splitlines()[0])

    def _serve(self) -> None:
        engine = self.engine
        while True:
            # Idle: block until a command comes. Busy: take what has come and step.
            commands = [] if engine.has_unfinished_requests() else self._wait_for_arrivals()
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            # Taken off the queue, not yet applied: if the loop dies meanwhile, _die answers them.
            self._unapplied = commands
            while commands:
                command = commands[0]
                if command is _STOP:
                    self._abort_all("the server stopped")
                    return
                self._apply(command)
                commands.pop(0)
            if engine.has_unfinished_requests():
                self._step()

    def _wait_for_arrivals(self) -> list:
        """The idle engine's first command, and every request that follows it closely.

        Requests sent together reach the engine one by one, a fraction of a millisecond
        apart. Stepping on the first alone would run its prefill by itself while the others
        queue behind that step; in-process, where a burst is queued before the first step,
        they would have shared it. So after a request wakes an idle engine, the loop keeps
        taking arrivals until none has come for ``arrival_window_s`` (at most ten windows in
        all). A lone request pays one window; a busy engine never waits."""
        commands = [self._next_command()]
        if self.arrival_window_s <= 0 or not isinstance(commands[0], RequestHandle):
            return commands
        deadline = time.perf_counter() + 10 * self.arrival_window_s
        while (left := deadline - time.perf_counter()) > 0:
            try:
                commands.append(self._commands.get(timeout=min(self.arrival_window_s, left)))
            except queue.Empty:
                break
        return commands

    def _next_command(self) -> object:
        """Block until a command comes; with worker processes, probe them meanwhile."""
        if self._probe is None:
            return self._commands.get()
        while True:
            try:
                return self._commands.get(timeout=LIVENESS_PROBE_S)
            except queue.Empty:
                self._probe()  # raises when a process the forward needs is gone

    def _die(self, reason: str) -> None:
        """The engine can no longer serve: say why, answer everything in flight and every
        later request with a 503, tell the server, and wait for the stop."""
        self.failure = reason
        logger.error("the engine can no longer serve: %s", reason)
        if self.metrics is not None:
            self.metrics.engine_failed()
        for command in self._unapplied:
            if isinstance(command, RequestHandle) and command.request_id not in self._handles:
                command.push(Update(command.index, [], error=dead_engine_error(reason)))
        self._unapplied = []
        try:
            self._abort_all(f"the engine can no longer serve: {reason}", "engine_dead")
        except Exception:  # noqa: BLE001 - the handles are answered below all the same
            logger.exception("aborting the requests in flight failed")
            for handle in list(self._handles.values()):
                handle.push(Update(handle.index, [], error=dead_engine_error(reason)))
            self._handles.clear()
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_failure failed")
        while True:  # a request submitted meanwhile still gets its answer
            command = self._commands.get()
            if command is _STOP:
                return
            if isinstance(command, RequestHandle):
                self._num_taken += 1
                command.push(Update(command.index, [], error=dead_engine_error(reason)))

    def _apply(self, command: RequestHandle | RequestId | object) -> None:
        if command is _ABORT_ALL:
            self._abort_all("the server is shutting down")
        elif isinstance(command, RequestHandle):
            self._num_taken += 1
            if self._defer and command.after in self._handles:
                self._deferred.setdefault(command.after, []).append(command)
                self._num_deferred += 1
            else:
                self._add(command)
        else:
            self._abort(command)

    def _abort(self, request_id: RequestId) -> None:
        for after, waiting in self._deferred.items():
            for handle in waiting:
                if handle.request_id == request_id:
                    waiting.remove(handle)
                    self._num_deferred -= 1
                    if not waiting:
                        del self._deferred[after]
                    return
        self._release(request_id)
        handle = self._handles.pop(request_id, None)
        request = self.engine.requests.get(request_id)
        if handle is not None and request is not None:
            self.engine.abort(request_id)
            self.metrics.finished(request)

    def _release(self, request_id: RequestId) -> None:
        """Add the choices that waited for this request's prompt."""
        for handle in self._deferred.pop(request_id, []):
            self._num_deferred -= 1
            self._add(handle)

    def _add(self, handle: RequestHandle) -> None:
        try:
            self.engine.add_request(handle.prompt_ids, handle.params, stop=handle.stop,
                                    request_id=handle.request_id, arrival_time=handle.arrival)
        except MiniInferError as exc:  # the handler checked first; this is a second line
            handle.push(Update(handle.index, [], error=APIError(400, str(exc))))
        else:
            self._handles[handle.request_id] = handle

    def _abort_all(self, message: str, code: str | None = None) -> None:
        stop = False
        while True:  # requests still on the queue get the same answer
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            stop = stop or command is _STOP
            if isinstance(command, RequestHandle):
                self._num_taken += 1
                command.push(Update(command.index, [], error=APIError(
                    503, message, "server_error", code=code)))
        for waiting in self._deferred.values():
            for handle in waiting:
                handle.push(Update(handle.index, [], error=APIError(
                    503, message, "server_error", code=code)))
        self._deferred.clear()
        self._num_deferred = 0
        for request_id, handle in list(self._handles.items()):
            request = self.engine.requests[request_id]
            self.engine.abort(request_id)
            self.metrics.finished(request)
            handle.push(Update(handle.index, [], error=APIError(
                503, f"{message}; request aborted", "server_error", code=code)))
        self._handles.clear()
        if stop:  # taken off the queue with the requests: the loop must still see it
            self._commands.put(_STOP)

    def _step(self) -> None:
        before = {rid: r.num_preemptions for rid, r in self.engine.requests.items()}
        try:
            result = self.engine.step()
        except Exception as exc:
            if _is_fatal(exc):
                raise  # _run: the engine is done
            # The step put the requests it held back in the waiting queue (nothing is lost);
            # they are the suspects.
            logger.exception("a step failed; running its requests one at a time to find which")
            suspects = [r for rid, r in self.engine.requests.items()
                        if r.num_preemptions > before.get(rid, r.num_preemptions)]
            self._isolate(suspects)
        else:
            self._publish(result)

    def _publish(self, result: StepResult) -> None:
        if result.preempted:
            self.metrics.preempted(len(result.preempted))
        updates = []
        for request in result.outputs:
            handle = self._handles.get(request.request_id)
            if handle is None:
                continue
            start = handle.num_pushed
            handle.num_pushed = len(request.output_ids)
            if start == 0:
                self.metrics.first_token(request)
                self._release(request.request_id)
            self.metrics.tokens(request, start)
            if request.finished:
                del self._handles[request.request_id]
                self.metrics.finished(request)
            updates.append((handle, Update(handle.index, request.output_ids[start:],
                                           request.finish_reason,
                                           logprobs=request.output_logprobs[start:],
                                           cumulative_logprob=request.cumulative_logprob)))
        if updates:
            # One wake-up of the event loop per step, not one per request (all handles live
            # on the server's one event loop).
            updates[0][0].event_loop.call_soon_threadsafe(_put_all, updates)

    def _isolate(self, suspects: list[Request]) -> None:
        """One forward serves many requests, so an exception in it does not say whose it is.
        Each suspect runs alone until it produces a token: the one that fails again gets a
        500 and leaves; the others go back to the front of the queue, and the loop serves on."""
        scheduler = self.engine.scheduler
        others = [r for r in scheduler.set_aside() if r not in suspects]
        cleared = []
        for request in suspects:
            scheduler.add(request)
            num_tokens = len(request.output_ids)
            try:
                while not request.finished and len(request.output_ids) == num_tokens:
                    self._publish(self.engine.step())
            except Exception as exc:
                if _is_fatal(exc):
                    raise
                self._fail(request, exc)
                continue
            if not request.finished:
                scheduler.take_out(request)
                cleared.append(request)
        scheduler.put_back(cleared + others)

    def _fail(self, request: Request, exc: Exception) -> None:
        logger.error("request %s failed: %r", request.request_id, exc)
        handle = self._handles.pop(request.request_id, None)
        self.engine.abort(request.request_id)
        self.metrics.failed()
        self._release(request.request_id)
        if handle is not None:
            handle.push(Update(handle.index, [], error=APIError(
                500, f"the engine failed on this request: {type(exc).__name__}: {exc}",
                "server_error")))



def dead_engine_error(reason: str) -> APIError:
    """What every request gets once the engine can no longer serve, and ``/health`` too."""
    return APIError(503, f"the engine can no longer serve: {reason}", "server_error",
                    code="engine_dead")
