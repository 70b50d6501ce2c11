"""Engines behind streams (issue 61): a replica serves requests that come from elsewhere, and the
HTTP app talks to it through the same `Engine` interface it uses in one process.

    replica side   `EngineReplica.generate(request)`: one engine's handle as a stream of messages
                   ({"accepted"} or {"error"}, then {"tokens": [...]} as they come, then the
                   end: finish reason, stop matched, prefix tokens, passes, drafts)
    ingress side   `RemoteEngine.submit(request)` -> a `RemoteHandle`, a `Handle` fed by that
                   stream (`open_stream(request)`: an async iterator of those messages)

What crosses is plain data (`portable`): the request's own fields, its grammar as its spec and
grammar text (the replica compiles it for its tokenizer, cached), its deadline as seconds left.
Ray Serve carries the stream between processes (`ray_app.py`); in one process a replica is its
own `open_stream`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from ..api import request as R
from ..decoding import grammar as G
from .handles import BadRequest, Cancelled, Handle, MemoryBudgetError, QueueFull, ReplicaUnavailable, RequestTimeout

ERRORS = {c.__name__: c for c in (ValueError, RuntimeError, BadRequest, QueueFull, MemoryBudgetError,
                                  RequestTimeout, Cancelled)}  # what a replica's error is raised as here


def portable(request: R.Request) -> R.Request:
    """The request as it crosses to a replica (which checks it against its model again)."""
    g = request.params.response_format
    params = request.params if g is None else dataclasses.replace(request.params, response_format=(g.key, g.grammar))
    left = None if request.deadline is None else request.deadline - time.perf_counter()
    return R.Request(np.asarray(request.prompt, np.int32), params, request.plan, request.cache_window, left)


def restored(request: R.Request, tokenizer, vocab_size: int) -> R.Request:
    """A `portable` request back as this process's: its grammar compiled for `tokenizer`."""
    g = request.params.response_format
    params = request.params if g is None else dataclasses.replace(
        request.params, response_format=G.rebuilt(g[0], g[1], tokenizer, vocab_size))
    deadline = None if request.deadline is None else time.perf_counter() + request.deadline
    return R.Request(request.prompt, params, request.plan, request.cache_window, deadline)


def _error(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def _raised(error: tuple[str, str]) -> BaseException:
    return ERRORS.get(error[0], RuntimeError)(error[1])


class EngineReplica:
    """One engine (and its tokenizer) serving `portable` requests as streams; `name` (default:
    host and process id) is told with each accepted request."""

    def __init__(self, engine, tokenizer, name: str | None = None):
        import os
        import socket

        self.engine, self.tokenizer = engine, tokenizer
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"

    async def generate(self, request: R.Request):
        """The request's messages (see the module's docstring); closing the stream early cancels it."""
        try:
            h = self.engine.submit(restored(request, self.tokenizer, self.engine.model.weights.config.vocab_size))
        except Exception as e:  # noqa: BLE001 - the ingress raises it as its own kind
            yield dict(error=_error(e))
            return
        yield dict(accepted=self.name)
        error = None
        try:
            async for chunk in h.achunks():
                yield dict(tokens=list(chunk))
        except Exception as e:  # noqa: BLE001 - the request's end, reported below
            error = e
        finally:
            if not h.done:
                h.cancel()
        yield dict(finish_reason=h.finish_reason, stop_matched=h.stop_matched, prefix_tokens=h.prefix_tokens,
                   passes=list(h.passes), drafted=h.drafted, accepted_drafts=h.accepted,
                   error=None if error is None else _error(error))


class RemoteHandle(Handle):
    """A `Handle` whose tokens come from a replica's stream (read by a task on the running
    event loop); `cancel()` closes the stream, which cancels the request there. on_end(handle):
    called once it ended (the ingress's counters)."""

    def __init__(self, request: R.Request, stream, on_end=lambda h: None):
        super().__init__(request, on_cancel=lambda h: h._task.cancel())
        self._on_end = on_end
        self.matcher = None  # (the replica's engine follows the grammar)
        loop = asyncio.get_running_loop()
        self._accepted = loop.create_future()
        self._task = loop.create_task(self._pump(stream))

    async def aaccepted(self) -> None:
        """Wait until the replica queued the request; raise what it refused it with."""
        await asyncio.shield(self._accepted)

    def _settle(self, error: BaseException | None = None) -> None:
        if not self._accepted.done():
            if error is None:
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(error)

    async def _pump(self, stream) -> None:
        try:
            async for msg in stream:
                if "tokens" in msg:
                    for t in msg["tokens"]:
                        self.emit(int(t), wake=False)
                    self.wake()
                elif "accepted" in msg:
                    self.replica = msg["accepted"]
                    self._settle()
                elif "finish_reason" in msg:
                    self.stop_matched, self.prefix_tokens = msg["stop_matched"], msg["prefix_tokens"]
                    self.passes, self.drafted, self.accepted = msg["passes"], msg["drafted"], msg["accepted_drafts"]
                    self.finish(msg["finish_reason"], None if msg["error"] is None else _raised(msg["error"]))
                else:  # refused at submit
                    e = _raised(msg["error"])
                    self._settle(e)
                    self.finish("error", e)
        except asyncio.CancelledError:
            self.finish("cancelled", Cancelled(f"request {self.id} was cancelled"))
        except Exception as e:  # noqa: BLE001 - the replica or the stream failed: the request fails, not the ingress
            error = ReplicaUnavailable(f"the replica serving request {self.id} failed: {type(e).__name__}: {e}")
            self._settle(error)
            self.finish("error", error)
        finally:
            self._settle(ReplicaUnavailable(f"the replica ended request {self.id} before queueing it"))
            if not self.done:
                self.finish("error", ReplicaUnavailable(f"the replica's stream for request {self.id} ended early"))
            self._on_end(self)
            if hasattr(stream, "aclose"):  # an async generator (in one process)
                await stream.aclose()
            elif hasattr(stream, "cancel") and self.finish_reason in ("cancelled", "error"):  # Ray Serve's
                stream.cancel()  # response stream, left early: the request is cancelled there


class RemoteModel:
    """The served model as an ingress that loads no weights needs it: its config, asked of a
    replica (`describe()`, from a thread: `fetch`), and `score`, run on a replica."""

    def __init__(self, describe, score):
        self._describe, self._score, self._config = describe, score, None

    def fetch(self) -> bool:
        """The config, once a replica answers (call it off the event loop); True once known."""
        if self._config is None:
            try:
                self._config = self._describe()
            except Exception:  # noqa: BLE001 - no replica up yet: the next poll asks again
                return False
        return True

    @property
    def described(self) -> bool:
        return self._config is not None

    @property
    def weights(self):
        import types

        if self._config is None:
            raise ReplicaUnavailable("no engine replica has described the model yet (the server is starting)")
        return types.SimpleNamespace(config=self._config)

    async def ascore(self, tokens, loops=None, top_logprobs: int = 0):
        """`Model.score` on a replica, awaited on the event loop (`score(...)`: an awaitable, a
        Ray Serve response)."""
        return await self._score([int(t) for t in tokens], loops, int(top_logprobs))


class RemoteEngine:
    """The `Engine` interface of the HTTP app over replicas: `open_stream(portable request)` ->
    an async iterator of a replica's messages (`EngineReplica.generate`, wherever it runs).
    model: the served model (its config checks requests; best_of scores with it). `stats()`
    counts what the ingress sees — requests, tokens, cached prompt tokens, finishes, in flight
    — in all and per replica (`replicas`), beside each replica's engine's own gauges (`stats()`:
    replica -> its `Engine.stats()`, as last polled; its queue summed into `queue_depth`), and
    (`running()`: the replicas Ray runs) how many run and how many answer the poll."""

    REPLICA_GAUGES = ("queue_depth", "running", "prefix_hit_rate", "memory_bytes", "tokens_per_second",
                      "ttft_p50_s", "ttft_p99_s")

    def __init__(self, model, open_stream, max_loops: int, stats=dict, warming=lambda: False, running=lambda: None):
        self.model, self.max_loops = model, max_loops
        self._open, self._stats, self._warming, self._running = open_stream, stats, warming, running
        self._counts: dict = {}  # replica -> counters
        self._flight = 0
        self._started = time.perf_counter()

    def submit(self, request: R.Request) -> RemoteHandle:
        self._flight += 1
        return RemoteHandle(request, self._open(portable(request)), self._ended)

    def _zero(self) -> dict:
        return dict.fromkeys(("requests", "tokens_in", "tokens_out", "prefix_tokens_reused", "requests_prefix_hit",
                              "requests_prefix_miss", "requests_failed"), 0)

    def _ended(self, h: RemoteHandle) -> None:
        self._flight -= 1
        c = self._counts.setdefault(h.replica or "(none)", self._zero())
        c["requests"] += 1
        c["tokens_in"] += len(h.prompt)
        c["tokens_out"] += len(h.tokens)
        c["prefix_tokens_reused"] += h.prefix_tokens
        c["requests_prefix_hit" if h.prefix_tokens else "requests_prefix_miss"] += 1
        c["requests_failed"] += h.finish_reason == "error"
        c[f"finished_{h.finish_reason}"] = c.get(f"finished_{h.finish_reason}", 0) + 1

    @property
    def warming(self) -> bool:
        return self._warming()

    def stalled(self) -> str | None:  # (each replica's own: Ray's `check_health` restarts it)
        return None

    def stats(self) -> dict:
        s: dict = {}
        replicas = {r: dict(c) for r, c in self._counts.items()}
        for c in replicas.values():
            for k, v in c.items():
                s[k] = s.get(k, 0) + v
        polled = self._stats()
        for r, own in polled.items():  # each engine's own view
            replicas.setdefault(r, self._zero()).update({k: own.get(k, 0) for k in self.REPLICA_GAUGES})
            s["queue_depth"] = s.get("queue_depth", 0) + own.get("queue_depth", 0)
        if self._running() is not None:  # (Ray's count, and how many of them answer the poll)
            s["replicas_running"], s["replicas_answering"] = self._running(), len(polled)
        n = s.get("requests_prefix_hit", 0) + s.get("requests_prefix_miss", 0)
        s["prefix_hit_rate"] = s.get("requests_prefix_hit", 0) / n if n else 0.0
        s["running"] = self._flight
        up = time.perf_counter() - self._started
        s["tokens_per_second"] = s.get("tokens_out", 0) / up if up > 0 else 0.0
        s["replicas"] = replicas
        return s
