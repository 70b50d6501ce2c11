"""The completion routes after parsing: a request's choices fanned out to the engine (`fan_out`:
n and best_of), then rendered as one JSON object (`whole`) or a stream of server-sent events
(`events`), in OpenAI's shapes (`protocol.TextShape`, `protocol.ChatShape`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass

from .engine import Engine
from .handles import ReplicaUnavailable, RequestTimeout
from . import tools as T
from .protocol import ChatShape, chat_logprobs, completion_logprobs, error_body
from ..api.chat import Detokenizer


async def fan_out(engine: Engine, req) -> list[list]:
    """Every prompt's best_of candidates as engine requests (None for each when max_tokens is 0:
    echo only). A prompt's other candidates are submitted once the first one's prompt is
    prefilled: its pages are then in the pool, and they read them there (one prefill)."""
    if req.submit["max_tokens"] == 0:
        return [list(c) for c in req.choices]
    groups = []
    try:
        for c in req.choices:
            groups.append([engine.submit(c[0])])
        await asyncio.gather(*(g[0].aaccepted() for g in groups))  # (a replica's refusal raised here)
        if req.best_of > 1:
            await asyncio.gather(*(g[0].aprefilled() for g in groups))
            for g, c in zip(groups, req.choices):
                g += [engine.submit(r) for r in c[1:]]
            await asyncio.gather(*(h.aaccepted() for g in groups for h in g[1:]))
    except BaseException:
        for h in (h for g in groups for h in g):
            h.cancel()
        raise
    return groups


@dataclass
class Reply:
    """One request's answer being rendered: its parsed body, its candidates' handles by prompt
    (`fan_out`), the response shape, and what every object of it carries."""

    server: "object"  # `app.Server`
    req: object  # `protocol.Parsed`, checked
    groups: list
    shape: type

    def __post_init__(self):
        self.handles = [h for g in self.groups for h in g if h is not None]
        first = self.handles[0].id if self.handles else 0
        self.id = f"{self.shape.id_prefix}-{first}-{secrets.token_hex(6)}"
        self.echoed = [self.server.tokenizer.decode(p) if self.req.echo else "" for p in self.req.prompts]

    def wrap(self, obj: str, choices: list, usage=None) -> dict:
        out = dict(id=self.id, object=obj, created=int(time.time()), model=self.server.model_name, choices=choices)
        replica = next((h.replica for h in self.handles if h.replica is not None), None)
        if replica is not None:  # (several engines: the one that served it)
            out["system_fingerprint"] = f"tinyloop-{replica}"
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(self, completion_tokens: int) -> dict:
        p = sum(map(len, self.req.prompts))
        cached = sum(max((h.prefix_tokens for h in g if h is not None), default=0) for g in self.groups)
        return dict(prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens,
                    prompt_tokens_details=dict(cached_tokens=cached))


async def collect(tokenizer, h, stops: list[str]) -> tuple[Detokenizer, str]:
    """A candidate's whole answer: (its text so far, finish reason)."""
    text = Detokenizer(tokenizer, stops)
    if h is None:
        return text, "length"
    async with aclosing(h.astream()) as tokens:
        async for t in tokens:
            text.add([t])
            if text.stopped:
                h.cancel()
                break
    text.finish(len(h.stop_matched or ()))
    return text, "stop" if text.stopped or h.finish_reason == "stop" else "length"


def mean_logprob(scores, start: int) -> float:
    """Mean log-probability of the tokens from `start` on (0 if there are none)."""
    lp = scores.logprobs[start:]
    return float(lp.mean()) if len(lp) else 0.0


async def whole(r: Reply) -> tuple[int, dict]:
    """The answer as one object: every candidate collected, best_of's likeliest n kept (scored by
    `Model.score` of prompt + completion, recomputed from scratch off the event loop, so a
    prompt read from a cached prefix scores as one that was not). Returns (status, body)."""
    req, shape, tokenizer, model = r.req, r.shape, r.server.tokenizer, r.server.engine.model
    try:
        done = await asyncio.gather(*(asyncio.gather(*(collect(tokenizer, h, req.stops) for h in g))
                                      for g in r.groups))
    except RequestTimeout as e:
        return 504, error_body(str(e), "timeout")
    except ReplicaUnavailable as e:
        return 503, error_body(str(e), "service_unavailable")
    except RuntimeError as e:
        return 500, error_body(str(e), "server_error")
    finally:
        for h in r.handles:
            h.cancel()
    choices = []
    for pi, (prompt, g, answers) in enumerate(zip(req.prompts, r.groups, done)):
        picked = [(j, None) for j in range(req.n)]
        if req.logprobs is not None or req.best_of > req.n:
            top, loops = req.logprobs or 0, req.submit.get("loops")
            remote = getattr(model, "ascore", None)  # (replicas: scored on one, one call at a time — Ray
            # Serve loses a second call made at once from one request's context: seen hanging)
            scores = ([await remote(prompt + list(t.ids), loops, top) for t, _ in answers] if remote else
                      await asyncio.gather(*(asyncio.to_thread(model.score, prompt + list(t.ids), loops=loops,
                                                               top_logprobs=top) for t, _ in answers)))
            picked = [(j, scores[j]) for j in range(len(answers))]
            if req.best_of > req.n:  # the likeliest per token (OpenAI's best_of)
                picked = sorted(picked, key=lambda js: -mean_logprob(js[1], len(prompt)))[:req.n]
        for k, (j, sc) in enumerate(picked):
            text, reason = answers[j]
            ids = list(text.ids)
            lp = None
            if req.logprobs is not None:
                lp = (chat_logprobs(tokenizer, prompt + ids[:len(ids) - len(g[j].stop_matched or ())], sc, len(prompt))
                      if shape is ChatShape
                      else completion_logprobs(tokenizer, prompt + ids, sc, 0 if req.echo else len(prompt)))
            calls = None if req.tools is None else T.calls_in(text.sent, req.tools)
            choices.append(shape.choice(pi * req.n + k, r.echoed[pi] + text.sent, ids, reason, False, lp)
                           if calls is None else shape.calls(pi * req.n + k, calls, ids, False, lp))
    total = sum(len(t.ids) for answers in done for t, _ in answers)
    return 200, r.wrap(shape.full_object, choices, r.usage(total))


async def events(r: Reply):
    """The answer as server-sent events: each candidate's chunks as its tokens come (the tokens
    that came together, a burst of decode steps, as one chunk), what is ready in one write; an
    error after the headers went out as an error event; usage last if asked; then [DONE]."""
    req, shape = r.req, r.shape
    queue: asyncio.Queue = asyncio.Queue()
    counts = [0] * (len(req.prompts) * req.n)

    async def pump(index: int, h, prefix_text: str):
        text = Detokenizer(r.server.tokenizer, req.stops)
        try:
            if shape.opening(index) is not None:
                await queue.put(r.wrap(shape.chunk_object, [shape.opening(index)]))
            if prefix_text:
                await queue.put(r.wrap(shape.chunk_object, [shape.choice(index, prefix_text, [], None, True)]))
            held = req.tools is not None  # an answer that may be a tool call goes out whole, at its end
            kept, kept_ids = "", []
            async with aclosing(h.achunks() if h is not None else _nothing()) as lists:
                async for new in lists:
                    ids, delta = [], ""
                    for t in new:
                        ids.append(t)
                        delta += text.add([t])
                        if text.stopped:
                            break
                    counts[index] += len(ids)
                    if held:
                        kept, kept_ids = kept + delta, kept_ids + ids
                    else:
                        await queue.put(r.wrap(shape.chunk_object, [shape.choice(index, delta, ids, None, True)]))
                    if text.stopped:
                        h.cancel()
                        break
            stopped = h is not None and h.finish_reason == "stop"
            reason = "stop" if text.stopped or stopped else "length"
            tail = text.finish(len(h.stop_matched or ()) if h is not None else 0)
            calls = T.calls_in(kept + tail, req.tools) if held else None
            if calls is not None:
                await queue.put(r.wrap(shape.chunk_object, [shape.calls(index, calls, kept_ids, True)]))
            else:
                await queue.put(r.wrap(shape.chunk_object, [shape.choice(index, kept + tail, kept_ids, reason, True)]))
        except RuntimeError as e:  # a deadline or a failed step, after the headers went out
            await queue.put(error_body(str(e), "server_error"))
        finally:
            if h is not None:
                h.cancel()  # a client that went away frees its row (no effect once done)
            await queue.put(None)

    tasks = [asyncio.create_task(pump(pi * req.n + j, h, r.echoed[pi]))
             for pi, g in enumerate(r.groups) for j, h in enumerate(g)]
    try:
        left = len(tasks)
        while left:
            items = [await queue.get()]
            while not queue.empty():  # what is ready goes out in one write
                items.append(queue.get_nowait())
            left -= sum(item is None for item in items)
            out = "".join(f"data: {json.dumps(item)}\n\n" for item in items if item is not None)
            if out:
                yield out
        if req.include_usage:
            yield f"data: {json.dumps(r.wrap(shape.chunk_object, [], r.usage(sum(counts))))}\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for h in r.handles:
            h.cancel()
    yield "data: [DONE]\n\n"


async def _nothing():
    return
    yield
