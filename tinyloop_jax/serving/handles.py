"""What a caller holds: a submitted request's `Handle` (blocking, streaming and asyncio faces),
the `Request` it carries unchanged, and the errors a request ends with. The engine's loop thread fills a
handle (`emit`, `finish`); any thread reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from typing import Callable

from ..api.request import Request


class BadRequest(ValueError):
    """A request the edge refuses before the engine sees it (the server's HTTP 400), naming its
    field (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """`submit` when the engine's queue is full (the server's HTTP 429)."""


class MemoryBudgetError(RuntimeError):
    """A request whose depth cannot fit the engine's `memory_budget`, even with every other
    depth evicted (the server's HTTP 400: the request itself is too large)."""


class ReplicaUnavailable(RuntimeError):
    """The replica serving a request failed or went away (`replica.RemoteHandle`): a 503."""


class RequestTimeout(RuntimeError):
    """A request that passed its deadline (`timeout`)."""


class Cancelled(RuntimeError):
    """`result()` of a cancelled request."""


class Handle:
    """A submitted request. `result()` blocks for prompt + emitted tokens (what `generate`
    returns); `stream()` yields emitted token ids as they come; `cancel()` frees its row.
    `aresult()` / `astream()` are the same for asyncio code."""

    _ids = itertools.count()

    def __init__(self, request: Request, on_cancel: Callable[["Handle"], None] = lambda h: None):
        self.id = next(Handle._ids)
        self.request = request  # checked (`api.request.checked`); travels the engine unchanged
        self.passes: list[int] = []  # with a policy: the passes run for each emitted token
        self.drafted = self.accepted = 0  # with speculation: drafts made and kept
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "timeout" | "error"
        self.stop_matched: list[int] | None = None  # the stop sequence that ended it
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.prefix_tokens = 0  # prompt tokens read from a cached prefix
        self.replica: str | None = None  # the replica that serves it (`replica.RemoteHandle`; None: this process)
        self._on_cancel = on_cancel  # the engine frees a queued request's place at once
        self.cancel_requested = False
        lock = threading.RLock()
        self._cv = threading.Condition(lock)  # (every token and the end: streams)
        self._ended = threading.Condition(lock)  # (the end alone: `result()`, never woken a token)
        self._wakers: list = []  # asyncio readers': every token and the end
        self._end_wakers: list = []  # the end alone
        g = request.params.response_format  # structured output: the grammar's matcher, fed each token
        self.matcher = None if g is None else g.matcher()

    # the request's parts, read by the batcher
    prompt = property(lambda self: self.request.prompt)  # [T] int32
    params = property(lambda self: self.request.params)
    loops = property(lambda self: self.request.loops)
    deadline = property(lambda self: self.request.deadline)
    cache_window = property(lambda self: self.request.cache_window)  # > 0: attend to the last ones only
    policy = property(lambda self: self.request.policy)  # adaptive depth's exit rule, or None
    in_prefill = property(lambda self: self.request.in_prefill)  # adaptive: the prompt exits as a whole
    speculation = property(lambda self: self.request.speculation)  # self-speculative decoding, or None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """Stop generating; the row is freed before the next step. No effect once done."""
        self.cancel_requested = True
        self._on_cancel(self)

    def overdue(self, now: float) -> tuple[str, BaseException] | None:
        """(finish reason, error) if the request must leave now (cancelled, or past its
        deadline at time `now`, a `time.perf_counter()` reading), else None."""
        if self.cancel_requested:
            return "cancelled", Cancelled(f"request {self.id} was cancelled")
        if self.deadline is not None and now > self.deadline:
            return "timeout", RequestTimeout(f"request {self.id} passed its deadline "
                                             f"({self.deadline - self.submitted:.3g} s)")
        return None

    # engine side
    def emit(self, tok: int, wake: bool = True) -> None:
        """The engine emitted `tok` for this request; wake=True wakes its readers (False: a
        burst's tokens before its last, which wakes them once for all: `wake()`)."""
        with self._cv:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
            self.tokens.append(tok)
        if wake:
            self.wake()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """The request ended (`finish_reason`; error: what `result()` raises). Only the first
        call counts."""
        with self._cv:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self.finished_at = time.perf_counter()
            self._cv.notify_all()
            self._ended.notify_all()
            wakers = self._wakers + self._end_wakers
        for w in wakers:
            w()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # caller side
    def result(self, timeout: float | None = None) -> list[int]:
        """prompt + emitted tokens; raises the request's error (Cancelled, RequestTimeout, ...)."""
        with self._ended:
            if not self._ended.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.id} is still running after {timeout} s")
        self._raise()
        return self.prompt.tolist() + list(self.tokens)

    def stream(self):
        """Emitted token ids as they come; ends when the request ends (raising its error, if any,
        except a cancel)."""
        i = 0
        while True:
            with self._cv:
                self._cv.wait_for(lambda: len(self.tokens) > i or self.done)
                new, done = self.tokens[i:], self.done
            i += len(new)
            yield from new
            if done and i == len(self.tokens):
                if not isinstance(self.error, Cancelled):
                    self._raise()
                return

    @contextlib.contextmanager
    def _woken(self, end_only: bool = False):
        """An asyncio.Event the engine sets whenever it emits or finishes (end_only: when it
        finishes) — for the loop's readers."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        wakers = self._end_wakers if end_only else self._wakers

        def wake():
            loop.call_soon_threadsafe(event.set)

        with self._cv:
            wakers.append(wake)
        try:
            yield event
        finally:
            with self._cv:
                wakers.remove(wake)

    async def astream(self):
        """`stream()` for asyncio: never blocks the event loop."""
        async for new in self.achunks():
            for t in new:
                yield t

    async def achunks(self):
        """`astream()` a list at a time: every token emitted since the last list (a burst of
        decode steps arrives together; a server sends it as one event)."""
        with self._woken() as event:
            i = 0
            while True:
                with self._cv:
                    event.clear()
                    new, done = self.tokens[i:], self.done
                i += len(new)
                if new:
                    yield new
                if done and i == len(self.tokens):
                    if not isinstance(self.error, Cancelled):
                        self._raise()
                    return
                if not new:
                    await event.wait()

    async def aaccepted(self) -> None:
        """Wait until the request is queued (here at once: `submit` raised what refused it; a
        `replica.RemoteHandle` waits for its replica)."""

    async def aprefilled(self) -> None:
        """Wait (asyncio) until the prompt is prefilled: the first token is out, or the request
        ended."""
        with self._woken() as event:
            while True:
                with self._cv:
                    event.clear()
                    if self.tokens or self.done:
                        return
                await event.wait()

    async def aresult(self) -> list[int]:
        """`result()` for asyncio (woken once, at the end)."""
        with self._woken(end_only=True) as event:
            while not self.done:
                await event.wait()
                event.clear()
        return self.result()
