"""AsyncEngine: runs a synchronous LLMEngine on its own thread and feeds asyncio consumers.

The engine is not thread-safe, so every call into it that changes state happens on the engine
thread: the asyncio side only validates (read-only) and posts commands to an inbox. Outputs of one
step are handed back to the event loop with a single `call_soon_threadsafe` per step.

    stream = aengine.open_stream()
    aengine.submit(stream, [(request_id, prompt_ids, params)])   # raises at once on a bad request
                                                                  # (lora_request=: an adapter name)
    async for request_id, out in stream: ...                      # SeqOutput deltas; ends by itself
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from jaxserve.engine.output import SeqOutput
from jaxserve.engine.sampling_params import SamplingParams, SamplingParamsError
from jaxserve.engine.sequence import FinishReason, Sequence

log = logging.getLogger("jaxserve.async_engine")


class QueueFull(RuntimeError):
    """Too many requests are waiting for admission (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down or is not running (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine failed while running this request (the engine itself keeps going)."""


_END = object()  # per-request end marker on a stream


class RequestStream:
    """Async iterator over (request_id, SeqOutput | exception) for one or more engine requests.

    Ends once every request submitted on it has ended (finished, aborted or failed). Lives on the
    event loop; the engine thread only reaches it through `call_soon_threadsafe`.
    """

    def __init__(self, engine: "AsyncEngine"):
        self._engine = engine
        self._queue: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._open: set[str] = set()
        self.request_ids: list[str] = []

    # called on the event loop
    def _put(self, rid: str, item: Any) -> None:
        if item is _END or isinstance(item, BaseException):
            self._engine._num_live -= 1  # counted here so an abandoned stream does not stay live
        self._queue.append((rid, item))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    @property
    def done(self) -> bool:
        return not self._open and not self._queue

    def abort(self) -> None:
        """Abort every request of this stream that has not ended (safe to call many times)."""
        for rid in list(self._open):
            self._engine.abort(rid)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            while self._queue:
                rid, item = self._queue.popleft()
                if item is _END:
                    self._open.discard(rid)
                    continue
                if isinstance(item, BaseException):
                    self._open.discard(rid)
                return rid, item
            if not self._open:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def drain_nowait(self) -> list:
        """Everything already delivered, without waiting (lets a writer batch one step's deltas)."""
        items = []
        while self._queue:
            rid, item = self._queue[0]
            if item is _END:
                self._queue.popleft()
                self._open.discard(rid)
                continue
            if isinstance(item, BaseException):
                break  # let __anext__ account for it
            items.append(self._queue.popleft())
        return items


@dataclass
class _Live:
    """Engine-thread bookkeeping of one request."""

    stream: RequestStream
    seqs: list[Sequence]
    reported: set[int] = field(default_factory=set)  # seq_ids whose final output went out


class AsyncEngine:
    def __init__(self, engine, max_queue: int = 256,
                 on_step: Callable[[dict, int], None] | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step  # called on the engine thread after each step: (stats, batch size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._stop = False
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._live: dict[str, _Live] = {}  # engine thread only
        self._queued_published = 0  # requests not yet fully admitted (read by the loop)
        self._num_live = 0  # event-loop side count of requests not ended
        self.stats: dict = dict(engine.stats())
        self.steps_failed = 0

    # ------------------------------------------------------------------ lifecycle (event loop)
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def num_queued(self) -> int:
        with self._cv:
            pending = sum(1 for c in self._inbox if c[0] == "add")
            return self._queued_published + pending

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let in-flight requests finish for up to grace_s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + max(grace_s, 0.0)
        while self._num_live > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._num_live > 0:
            log.warning("shutdown: aborting %d request(s) still running", self._num_live)
            self._post(("abort_all",))
            # give the handlers a moment to send their final chunks
            end = time.monotonic() + 2.0
            while self._num_live > 0 and time.monotonic() < end:
                await asyncio.sleep(0.02)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    # ------------------------------------------------------------------ submission (event loop)
    def open_stream(self) -> RequestStream:
        return RequestStream(self)

    def submit(self, stream: RequestStream,
               requests: list[tuple[str, list[int], SamplingParams]], lora_request=None) -> None:
        """Validate then enqueue requests, all or none. Raises at once:
        EngineStopped (503), QueueFull (429), or the engine's ValueError for a bad request (400).
        lora_request: the LoRA adapter (a name of the engine's lora_modules) all of them run with."""
        if not self._accepting or self._stop:
            raise EngineStopped("the server is shutting down" if self._thread else "the engine is not running")
        for _, ids, params in requests:
            self.engine.validate(ids, params)  # read-only: safe beside a running step
        if lora_request is not None:
            self.engine.lora_slot(lora_request)
        if 0 < self.max_queue < len(requests):  # could never be queued: not worth a retry
            raise SamplingParamsError(f"{len(requests)} prompts in one request exceed the queue limit "
                                      f"({self.max_queue}); send fewer at a time", "prompt")
        if self.max_queue > 0 and self.num_queued + len(requests) > self.max_queue:  # 0: no limit
            raise QueueFull(f"too many requests waiting ({self.max_queue} allowed); retry later")
        arrival = time.monotonic()
        for rid, _, _ in requests:
            stream._open.add(rid)
            stream.request_ids.append(rid)
        self._num_live += len(requests)
        with self._cv:
            for rid, ids, params in requests:
                self._inbox.append(("add", rid, ids, params, stream, arrival, lora_request))
            self._cv.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread between steps (it may change engine state); its result or
        exception comes back here."""
        if not self._accepting or self._stop or self._thread is None:
            raise EngineStopped("the server is shutting down" if self._thread else "the engine is not running")
        fut = asyncio.get_running_loop().create_future()
        with self._cv:  # _stop is set under this lock: a call posted before it is handled or failed
            if self._stop:
                raise EngineStopped("the server is shutting down")
            self._inbox.append(("call", fn, fut))
            self._cv.notify()
        return await fut

    def abort(self, request_id: str) -> None:
        """Stop a request; its KV blocks are freed before the next step. Never raises."""
        self._post(("abort", request_id))

    def _post(self, cmd: tuple) -> None:
        with self._cv:
            self._inbox.append(cmd)
            self._cv.notify()

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, items: list) -> None:
        if not items:
            return
        loop = self._loop

        def put_all():
            for stream, rid, item in items:
                stream._put(rid, item)

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            pass

    def _take_commands(self) -> list[tuple]:
        with self._cv:
            while not self._inbox and not self._stop and not self.engine.has_unfinished():
                self._cv.wait()
            cmds, self._inbox = self._inbox, []
            # count drained adds as queued until the next publish, so submit() never undercounts
            self._queued_published += sum(1 for c in cmds if c[0] == "add")
        return cmds

    def _run(self) -> None:
        log.debug("engine thread started")
        while True:
            cmds = self._take_commands()
            out: list = []
            for cmd in cmds:
                try:
                    self._handle(cmd, out)
                except Exception as e:  # never let one command stop the loop
                    if cmd[0] == "add" and isinstance(e, SamplingParamsError):
                        # the request's fault found after submit checked it (its adapter unloaded
                        # meanwhile): a 400 for it, not a 500
                        out.append((cmd[4], cmd[1], e))
                        continue
                    log.exception("engine command %s failed", cmd[0])
                    if cmd[0] == "add":
                        out.append((cmd[4], cmd[1], RequestFailed(f"could not add request: {e}")))
            if self._stop:
                self._abort_all(out)
                self._deliver(out)
                self._refuse_left()
                break
            batch = 0
            if self.engine.has_unfinished():
                try:
                    running_before = self.engine.scheduler.num_running
                    outs = self.engine.step()
                    batch = max(running_before, self.engine.scheduler.num_running,
                                len({o.seq.seq_id for o in outs}))
                except Exception as e:
                    self.steps_failed += 1
                    log.exception("engine step failed; failing the requests in it")
                    self._fail_running(e, out)
                else:
                    self._route(outs, out)
            self._sweep(out)
            self._publish(batch)
            self._deliver(out)
        log.debug("engine thread stopped")

    def _refuse_left(self) -> None:
        """Commands posted after the last drain, as the thread stops: their callers get EngineStopped (an
        add: its stream ends with it) instead of waiting for ever."""
        with self._cv:
            cmds, self._inbox = self._inbox, []
        err = EngineStopped("the server is shutting down")
        out = []
        for cmd in cmds:
            if cmd[0] == "call":
                fut = cmd[2]
                try:
                    self._loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_exception(err))
                except RuntimeError:  # loop closed
                    pass
            elif cmd[0] == "add":
                out.append((cmd[4], cmd[1], err))
        self._deliver(out)

    def _handle(self, cmd: tuple, out: list) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, stream, arrival, lora = cmd
            seqs = self.engine.add_request(rid, ids, params, arrival_time=arrival, lora_request=lora)
            self._live[rid] = _Live(stream, seqs)
        elif kind == "abort":
            self._abort(cmd[1], out)
        elif kind == "abort_all":
            self._abort_all(out)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                res, exc = fn(), None
            except Exception as e:
                res, exc = None, e
            settle = (lambda: fut.done() or fut.set_exception(exc)) if exc else (lambda: fut.done() or fut.set_result(res))
            try:
                self._loop.call_soon_threadsafe(settle)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _abort(self, rid: str, out: list) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        try:
            self.engine.abort_request(rid)
        except Exception:
            log.exception("abort of %s failed", rid)
        for s in live.seqs:
            if s.seq_id not in live.reported:
                if not s.is_finished:
                    s.finish(FinishReason.ABORT)
                out.append((live.stream, rid, SeqOutput(s, [], "", True)))
        out.append((live.stream, rid, _END))

    def _abort_all(self, out: list) -> None:
        for rid in list(self._live):
            self._abort(rid, out)

    def _route(self, outs: list[SeqOutput], out: list) -> None:
        for o in outs:
            rid = o.seq.request_id
            live = self._live.get(rid)
            if live is None:
                continue
            out.append((live.stream, rid, o))
            if o.finished:
                live.reported.add(o.seq.seq_id)
                if len(live.reported) == len(live.seqs):
                    del self._live[rid]
                    out.append((live.stream, rid, _END))

    def _sweep(self, out: list) -> None:
        """Report sequences the engine finished without emitting an output for them.

        The scheduler ends a sequence that can never fit inside schedule() (FinishReason.LENGTH);
        such a sequence is not in the step, so LLMEngine.step() returns nothing for it."""
        for rid in list(self._live):
            live = self._live[rid]
            for s in live.seqs:
                if s.is_finished and s.seq_id not in live.reported:
                    text, ids, lps = "", [], []
                    ts = self.engine.text_states.get(s.seq_id)
                    if ts is not None:
                        try:
                            res = ts.consume()
                            ids, text, lps = res[0], res[1], res[2]
                        except Exception:
                            log.exception("flushing text of seq %d failed", s.seq_id)
                    try:
                        self.engine._retire(s)
                    except Exception:
                        pass
                    live.reported.add(s.seq_id)
                    out.append((live.stream, rid, SeqOutput(s, ids, text, True, lps)))
            if len(live.reported) == len(live.seqs):
                del self._live[rid]
                out.append((live.stream, rid, _END))

    def _fail_running(self, err: Exception, out: list) -> None:
        # A step runs all running sequences together: we cannot tell which one broke it, so every
        # request that was in the step fails; waiting ones are left alone.
        hit = [rid for rid, lv in self._live.items()
               if any(s.status.value == "running" for s in lv.seqs)]
        if not hit:
            hit = list(self._live)
        for rid in hit:
            live = self._live.pop(rid)
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("cleanup of failed request %s failed", rid)
            out.append((live.stream, rid, RequestFailed(f"engine step failed: {type(err).__name__}: {err}")))

    def _publish(self, batch: int) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception:
            log.exception("engine stats failed")
            return
        waiting = {s.request_id for s in self.engine.scheduler.waiting}
        with self._cv:
            self._queued_published = len(waiting)
        stats["num_requests_waiting"] = len(waiting)
        stats["num_requests_live"] = len(self._live)
        stats["steps_failed"] = self.steps_failed
        self.stats = stats
        if self.on_step is not None:
            try:
                self.on_step(stats, batch)
            except Exception:
                log.exception("on_step callback failed")
