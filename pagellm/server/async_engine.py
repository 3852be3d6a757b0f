"""AsyncEngine: one LLMEngine stepped by one background thread, fed by asyncio callers.

    event loop (HTTP)                            engine thread
    ─────────────────                            ─────────────
    await add(...)  ── inbox (deque + cond) ──►  drain inbox: add_request / abort
    RequestStream   ◄── call_soon_threadsafe ──  step() -> outputs, put on each request's queue
    abort(ids)      ── inbox ───────────────────►

The LLMEngine is created and stepped only on its thread, so it needs no locks; from other threads
only its failure field is read and a grammar compiled into its thread-safe cache
(check_structured_outputs). The thread steps while work exists and sleeps on the condition
otherwise. Outputs go to unbounded asyncio queues, so the engine never waits for a slow client;
the HTTP side only ever awaits its own queue, so it never blocks the engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from pagellm.config import EngineConfig
from pagellm.distributed.parallel_state import DistributedError
from pagellm.engine_errors import StepError
from pagellm.outputs import RequestOutput
from pagellm.platform import release_cuda_library_pages
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger("pagellm.server")


class QueueFullError(Exception):
    """The waiting queue holds --max-waiting requests already (HTTP 429)."""


class EngineDeadError(Exception):
    """The engine stopped (shutdown or an internal error); the request cannot finish."""


class RequestFailedError(Exception):
    """This request alone failed inside the engine (the others go on): HTTP 500 with the cause, or 503 when the
    device ran out of memory running it (worth retrying later, or smaller)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


_CLOSED = object()  # queue item: the stream was aborted


@dataclass(frozen=True)
class ServedModel:
    """What the server needs to know of the loaded model: fixed at load, so safe to read from any thread."""

    path: str
    max_model_len: int
    vocab_size: int
    tokenizer: object | None  # pagellm.loader.tokenizer.Tokenizer; thread-safe (the text pool encodes with it)
    max_prompt_chars: int | None  # a longer text cannot fit max_model_len in any tokenization (None: no tokenizer)
    hidden_size: int = 0  # the width of its final hidden states: an embedding's dimensions


@dataclass
class _Tracked:
    """Per engine request, on the engine thread: where its outputs go and its timestamps."""

    stream: RequestStream
    index: int
    arrival: float
    last_token: float | None = None


class RequestStream:
    """The outputs of one HTTP request's engine requests (n completions × prompts), as they come.

    Iterating yields (index, RequestOutput). Leaving the iteration early (client gone,
    cancellation) aborts whatever has not finished, which returns its KV blocks to the pool.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self._unfinished = set(request_ids)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def put_threadsafe(self, item) -> None:
        """Called on the engine thread: an (index, RequestOutput) or an exception."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self._unfinished:
                item = await self._queue.get()
                if item is _CLOSED:
                    return
                if isinstance(item, BaseException):
                    raise item
                index, output = item
                if output.finished:
                    self._unfinished.discard(output.request_id)
                yield index, output
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort what has not finished and end the iteration (call on the event loop)."""
        if self._unfinished:
            self._engine.abort(list(self._unfinished))
            self._unfinished.clear()
            self._queue.put_nowait(_CLOSED)  # wakes an iteration waiting for outputs that will not come


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_waiting: int):
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.config = config
        self.max_waiting = max_waiting
        self.metrics = None  # ServerMetrics, set by the server before start()
        self.model: ServedModel | None = None  # set once the model is loaded
        self._engine = None  # the LLMEngine once loaded: touched only on the engine thread, except as noted
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None  # called on the engine thread
        self._inbox: collections.deque[tuple] = collections.deque()  # (fn(engine), loop, future)
        self._cond = threading.Condition()
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}
        self._stats: dict = {}  # replaced (never mutated) by the engine thread after each step
        self._counts = collections.Counter()  # engine-thread-only counters beyond engine.stats()
        self._ready = threading.Event()
        self._died: BaseException | None = None  # why the engine thread ended on an error
        self._out_of_memory: set[str] = set()  # requests failed because the device ran out of memory (503)
        self._thread = threading.Thread(target=self._run, name="pagellm-engine", daemon=True)

    # ---- event-loop side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.model is not None and not self._stopping and self.failure is None

    @property
    def failure(self) -> Exception | None:
        """Why the engine can no longer step (its thread died on an error; a worker rank died or hung), else None."""
        if self._died is not None:
            return EngineDeadError(f"the engine thread died: {type(self._died).__name__}: {self._died}")
        return self._engine.failure if self._engine is not None else None  # a field another thread sets

    def stats(self) -> dict:
        return self._stats

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Compile the request's grammar into the engine's cache (a ValueError if it cannot run). Called on the
        server's text pool, not the engine thread: compiling can take seconds, and the cache is thread-safe."""
        self._engine.check_structured_outputs(params)

    async def add(self, token_id_lists: list[list[int]], params: list[SamplingParams],
                  arrival_time: float, request_id: str) -> RequestStream:
        """Queue one engine request per (prompt, params); all are accepted or none is.

        Raises ValueError (a prompt the engine rejects), QueueFullError, EngineDeadError.
        """
        ids = [f"{request_id}-{i}" for i in range(len(token_id_lists))]
        stream = RequestStream(self, ids)
        future = asyncio.get_running_loop().create_future()

        def add_all(engine) -> None:
            if self.failure is not None:
                raise EngineDeadError(str(self.failure))
            if engine.num_waiting + len(ids) > self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")
            added = []
            try:
                for i, (rid, tokens, p) in enumerate(zip(ids, token_id_lists, params)):
                    engine.add_request(tokens, p, request_id=rid, arrival_time=arrival_time)
                    added.append(rid)
                    self._tracked[rid] = _Tracked(stream, i, arrival_time)
            except ValueError:
                for rid in added:
                    engine.abort(rid)
                    del self._tracked[rid]
                raise

        self._submit(add_all, future)
        try:
            await future
        except asyncio.CancelledError:  # client gone while queued for the engine thread
            stream.abort()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (thread-safe, fire and forget); unknown or finished ids are ignored."""

        def abort_all(engine) -> None:
            for rid in request_ids:
                if self._tracked.pop(rid, None) is not None:
                    engine.abort(rid)
                    self._counts["num_requests_aborted"] += 1

        self._submit(abort_all, None)

    def begin_shutdown(self) -> None:
        """Tell the thread to stop; every open stream gets EngineDeadError. Safe from a signal handler
        (the condition's lock is re-entrant) and safe to call twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """begin_shutdown(), then wait for the thread (not while it is still loading the model)."""
        self.begin_shutdown()
        if self.model is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def _submit(self, fn: Callable, future: asyncio.Future | None) -> None:
        if self._died is not None and future is not None:
            raise self.failure  # nobody would ever answer: fail now rather than hang
        if self._stopping:
            if future is None:
                return  # an abort during shutdown: the engine is dropping everything anyway
            raise EngineDeadError("the server is shutting down")
        loop = asyncio.get_running_loop() if future is not None else None
        with self._cond:
            self._inbox.append((fn, loop, future))
            self._cond.notify()

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            from pagellm.engine import LLMEngine

            engine = LLMEngine(self.config)
            tokenizer = engine.tokenizer
            max_chars = None if tokenizer is None else engine.max_model_len * tokenizer.max_chars_per_token
            served = ServedModel(str(engine.model_path), engine.max_model_len, engine.hf_config.vocab_size,
                                 tokenizer, max_chars, engine.hf_config.hidden_size)
        except BaseException as exc:  # noqa: BLE001 - reported by /health and the log, not raised
            if isinstance(exc, torch.OutOfMemoryError):
                exc = MemoryError(f"the model does not fit in the device's memory ({exc}); a smaller model, "
                                  "--max-model-len, --kv-cache-memory or --gpu-memory-utilization may")
            self.load_error = exc
            logger.error("model load failed: %s", exc)
            self._ready.set()
            if self.on_load_error is not None:
                self.on_load_error()
            return
        self._engine, self.model = engine, served
        self._publish_stats(engine)
        self._ready.set()
        logger.info("engine ready: max_model_len=%d", engine.max_model_len)
        if released := release_cuda_library_pages(engine.device):  # after /health turns ready: tens of ms
            logger.info("CUDA libraries' pages unmapped (a CPU engine runs none of them): %d MB", released >> 20)
        try:
            self._loop(engine)
            error = EngineDeadError("the server is shutting down")
        except BaseException as exc:  # noqa: BLE001 - /health reports it; every open and new request fails
            self._died = exc
            self._counts["engine_thread_deaths"] += 1
            logger.error("the engine thread died:\n%s", traceback.format_exc())
            error = self.failure
        finally:
            with self._cond:  # commands queued meanwhile are answered, not left waiting
                commands, self._inbox = list(self._inbox), collections.deque()
            for _, loop, future in commands:
                _resolve(loop, future, None, EngineDeadError("the engine stopped"))
        self._fail_all(error)
        engine.shutdown()  # a parallel engine's workers stop with it

    def _loop(self, engine) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                    self._cond.wait()
                commands, self._inbox = list(self._inbox), collections.deque()
                if self._stopping:
                    for _, loop, future in commands:
                        _resolve(loop, future, None, EngineDeadError("the server is shutting down"))
                    return
            for fn, loop, future in commands:
                try:
                    result, error = fn(engine), None
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    result, error = None, exc
                _resolve(loop, future, result, error)
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except DistributedError as exc:  # a worker rank is gone: fail what runs, refuse what comes
                    self._fail_all(EngineDeadError(str(exc)), engine)
                    continue
                except StepError as exc:
                    self._isolate(engine, exc)
                    continue
                self._deliver(outputs)
            self._publish_stats(engine)

    def _isolate(self, engine, error: StepError) -> None:
        """A step failed: find the request that makes it fail by stepping halves of its requests (the rest held
        back; a step that succeeds is real progress for its half) and fail that one alone."""
        self._counts["engine_step_failures"] += 1
        logger.error("engine step failed; isolating the request that fails it:\n%s",
                     "".join(traceback.format_exception(error.cause)))
        suspects = [rid for rid in error.request_ids if rid in self._tracked]
        if isinstance(error.cause, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed step's cached blocks back to the device: the halves may fit
        try:
            while len(suspects) > 1:
                half, rest = suspects[:len(suspects) // 2], suspects[len(suspects) // 2:]
                engine.hold(set(self._tracked) - set(half))
                try:
                    outputs = engine.step()
                except StepError:
                    suspects = half
                else:
                    self._deliver(outputs)
                    suspects = [rid for rid in rest if rid in self._tracked]
        finally:
            engine.hold(())
        why = f"internal error while generating: {type(error.cause).__name__}: {error.cause}"
        if isinstance(error.cause, torch.OutOfMemoryError):  # the request alone still does not fit
            why = (f"the device ran out of memory running this request ({error.cause}); retry later, or with a "
                   "shorter prompt or fewer tokens")
            self._out_of_memory.update(suspects)
        for rid in suspects:
            self._deliver([engine.fail_request(rid, why)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue
            if output.new_token_ids:
                self._counts["generation_tokens"] += len(output.new_token_ids)
                if metrics is not None:
                    if tracked.last_token is None:
                        metrics.time_to_first_token.observe(now - tracked.arrival)
                        scheduled = output.first_scheduled_time or now
                        metrics.request_queue_time.observe(max(scheduled - tracked.arrival, 0.0))
                    else:
                        metrics.inter_token_latency.observe(now - tracked.last_token)
                tracked.last_token = now
            if output.finished:
                del self._tracked[output.request_id]
                self._counts["num_requests_finished"] += 1
                if metrics is not None:
                    metrics.e2e_request_latency.observe(now - tracked.arrival)
            if output.error is not None:
                self._counts["num_requests_failed"] += 1
                status = 503 if output.request_id in self._out_of_memory else 500
                self._out_of_memory.discard(output.request_id)
                tracked.stream.put_threadsafe(RequestFailedError(output.error, status))
                continue
            tracked.stream.put_threadsafe((tracked.index, output))

    def _fail_all(self, error: Exception, engine=None) -> None:
        for rid, tracked in list(self._tracked.items()):
            if engine is not None:
                engine.abort(rid)
            tracked.stream.put_threadsafe(error)
        self._tracked.clear()

    def _publish_stats(self, engine) -> None:
        stats = engine.stats()
        total = stats["kv_blocks_total"]
        stats["kv_blocks_free"] = total - stats["kv_blocks_used"]
        stats["kv_cache_usage_ratio"] = stats["kv_blocks_used"] / total if total else 0.0
        stats.update(self._counts)
        self._stats = stats


def _resolve(loop, future, result, error) -> None:
    if future is None:
        if error is not None:
            logger.error("engine command failed: %s", error)
        return

    def settle() -> None:
        if future.done():  # the caller was cancelled (client gone) meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    loop.call_soon_threadsafe(settle)
