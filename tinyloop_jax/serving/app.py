"""`tinyloop serve`: an OpenAI-compatible HTTP API over the `Engine` (Starlette + uvicorn, the
`serve` extra).

    POST /v1/completions    prompt (text or token ids, or a list of several), max_tokens,
                            temperature, top_p, stop, seed, stream (server-sent events), n,
                            best_of, logprobs, echo; extras top_k, repetition_penalty, loops,
                            ignore_eos. Each choice also carries token_ids (the emitted ids) and
                            finish_reason "stop" | "length"; index = prompt number * n + j.
    POST /v1/chat/completions  messages (system / user / assistant, string content) through the
                            model's chat template; max_completion_tokens (or max_tokens) and the
                            rest as above. The answer stops at the template's end-of-turn ids,
                            which are not part of message.content; streamed chunks carry deltas,
                            the first one the role. A model with no chat template: HTTP 400.
    GET  /v1/models   /health   /metrics (Prometheus text; per-depth counters labelled `loops`)
    POST /tokenize  POST /detokenize  GET /tokenizer_info   vLLM's tokenizer routes (`tokenizer_api`)

OpenAI's presence_penalty, frequency_penalty and logit_bias are taken by both completion routes.
A prompt's n (best_of) choices are engine requests of their own with seeds `protocol.choice_seed`;
the others are submitted once the first one's prompt is prefilled, so a long prompt, pooled by
then, is read from its pages rather than prefilled again. Log-probabilities (`logprobs`,
`echo`; chat's `logprobs` / `top_logprobs`) come from `Model.score` of prompt + completion once a
choice is complete, on a worker thread: the raw logits' log-softmax, recomputed, so a cached
prefix changes nothing; they are not available with `stream`.
Request bodies and response objects: `protocol`. `usage.prompt_tokens_details.cached_tokens` says
how many prompt tokens were read from cached prefixes (a chat's earlier turns, a shared system
prompt) instead of being prefilled.

Bad requests get HTTP 400 with an OpenAI-style error body naming the field (every value is
checked before it reaches the engine: `protocol.check_submit`; a request too large for the memory
budget is a 400 too); a full queue 429; a request past its deadline 504.

At the edge (`edge`, make_app's keywords): `api_key` (401 without `Authorization: Bearer KEY` on
every route but /health and /metrics), `cors_origins` (none by default), `max_body` (413 past it,
default 4 MiB). The server has no TLS: it binds to 127.0.0.1 unless told otherwise, and anything
wider belongs behind a reverse proxy that terminates TLS.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from contextlib import aclosing

from . import edge, tokenizer_api
from .engine import Engine
from .handles import MemoryBudgetError, QueueFull, RequestTimeout
from .protocol import (BadRequest, ChatShape, TextShape, chat_logprobs, check_submit,
                       completion_logprobs, error_body, parse, parse_chat, with_choices)
from ..api.chat import Detokenizer


# ---- the app -----------------------------------------------------------------------------------

def make_app(engine: Engine, tokenizer, model_name: str = "tinyloop", eos: list[int] = (), *,
             api_key: str | None = None, cors_origins=(), max_body: int = 4 << 20):
    """The ASGI app over a running engine. api_key: the Bearer key every route but /health and
    /metrics needs (None: open); cors_origins: the browser origins allowed (none by default);
    max_body: the largest request body in bytes."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    cfg = engine.model.weights.config
    eos = list(eos)
    created = int(time.time())

    def fail(status: int, message: str, kind: str, param=None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param), status_code=status)

    async def submit_all(req) -> list[list]:
        """Every prompt's best_of candidates as engine requests (None for each when max_tokens is
        0: echo only). A prompt's other candidates are submitted once the first one's prompt is
        prefilled: its pages are then in the pool, and they read them there (one prefill)."""
        if req.submit["max_tokens"] == 0:
            return [list(c) for c in req.choices]
        groups = []
        try:
            for c in req.choices:
                groups.append([engine.submit(c[0])])
            if req.best_of > 1:
                await asyncio.gather(*(g[0].aprefilled() for g in groups))
                for g, c in zip(groups, req.choices):
                    g += [engine.submit(r) for r in c[1:]]
        except BaseException:
            for h in (h for g in groups for h in g):
                h.cancel()
            raise
        return groups

    async def collect(h, stops: list[str]) -> tuple[Detokenizer, str]:
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

    async def score_choice(prompt: list[int], ids: list[int], top: int, loops: int | None):
        """`Model.score` of prompt + completion (recomputed from scratch, so a prompt read from a
        cached prefix scores as one that was not), off the event loop."""
        return await asyncio.to_thread(engine.model.score, prompt + ids, loops=loops, top_logprobs=top)

    async def serve(request, parse_body, shape):
        """One request: parse, submit every choice, then the whole answer or a stream of chunks."""
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        try:
            req = parse_body(body)
            groups = await submit_all(req)
        except QueueFull as e:
            return fail(429, str(e), "rate_limit_error")
        except MemoryBudgetError as e:  # (a RuntimeError) this request can never fit, whatever waits
            return fail(400, str(e), "invalid_request_error")
        except BadRequest as e:
            return fail(400, str(e), "invalid_request_error", e.param)
        except (ValueError, RuntimeError) as e:
            return fail(400, str(e), "invalid_request_error")
        handles = [h for g in groups for h in g if h is not None]
        first = handles[0].id if handles else 0
        rid = f"{shape.id_prefix}-{first}-{secrets.token_hex(6)}"
        echoed = [tokenizer.decode(p) if req.echo else "" for p in req.prompts]

        def wrap(obj: str, choices: list, usage=None) -> dict:
            out = dict(id=rid, object=obj, created=int(time.time()), model=model_name, choices=choices)
            if usage is not None:
                out["usage"] = usage
            return out

        def usage(completion_tokens: int) -> dict:
            p = sum(map(len, req.prompts))
            cached = sum(max((h.prefix_tokens for h in g if h is not None), default=0) for g in groups)
            return dict(prompt_tokens=p, completion_tokens=completion_tokens, total_tokens=p + completion_tokens,
                        prompt_tokens_details=dict(cached_tokens=cached))

        if not req.stream:
            try:
                done = await asyncio.gather(*(asyncio.gather(*(collect(h, req.stops) for h in g)) for g in groups))
            except RequestTimeout as e:
                return fail(504, str(e), "timeout")
            except RuntimeError as e:
                return fail(500, str(e), "server_error")
            finally:
                for h in handles:
                    h.cancel()
            choices = []
            for pi, (prompt, g, answers) in enumerate(zip(req.prompts, groups, done)):
                picked = [(j, None) for j in range(req.n)]
                if req.logprobs is not None or req.best_of > req.n:
                    top = req.logprobs or 0
                    loops = req.submit.get("loops")
                    scores = await asyncio.gather(*(score_choice(prompt, list(t.ids), top, loops)
                                                    for t, _ in answers))
                    picked = [(j, scores[j]) for j in range(len(answers))]
                    if req.best_of > req.n:  # the likeliest per token (OpenAI's best_of)
                        picked = sorted(picked, key=lambda js: -mean_logprob(js[1], len(prompt)))[:req.n]
                for k, (j, sc) in enumerate(picked):
                    text, reason = answers[j]
                    ids = list(text.ids)
                    lp = None
                    if req.logprobs is not None:
                        lp = (chat_logprobs(tokenizer, prompt + ids[:len(ids) - len(g[j].stop_matched or ())],
                                            sc, len(prompt)) if shape is ChatShape
                              else completion_logprobs(tokenizer, prompt + ids, sc, 0 if req.echo else len(prompt)))
                    choices.append(shape.choice(pi * req.n + k, echoed[pi] + text.sent, ids, reason, False, lp))
            total = sum(len(t.ids) for answers in done for t, _ in answers)
            return JSONResponse(wrap(shape.full_object, choices, usage(total)))

        async def events():
            queue: asyncio.Queue = asyncio.Queue()
            counts = [0] * (len(req.prompts) * req.n)

            async def pump(index: int, h, prefix_text: str):
                text = Detokenizer(tokenizer, req.stops)
                try:
                    if shape.opening(index) is not None:
                        await queue.put(wrap(shape.chunk_object, [shape.opening(index)]))
                    if prefix_text:
                        await queue.put(wrap(shape.chunk_object, [shape.choice(index, prefix_text, [], None, True)]))
                    # the tokens that came together (a burst of decode steps) as one chunk
                    async with aclosing(h.achunks() if h is not None else _nothing()) as lists:
                        async for new in lists:
                            ids, delta = [], ""
                            for t in new:
                                ids.append(t)
                                delta += text.add([t])
                                if text.stopped:
                                    break
                            counts[index] += len(ids)
                            await queue.put(wrap(shape.chunk_object, [shape.choice(index, delta, ids, None, True)]))
                            if text.stopped:
                                h.cancel()
                                break
                    stopped = h is not None and h.finish_reason == "stop"
                    reason = "stop" if text.stopped or stopped else "length"
                    tail = text.finish(len(h.stop_matched or ()) if h is not None else 0)
                    await queue.put(wrap(shape.chunk_object, [shape.choice(index, tail, [], reason, True)]))
                except RuntimeError as e:  # a deadline or a failed step, after the headers went out
                    await queue.put(error_body(str(e), "server_error"))
                finally:
                    if h is not None:
                        h.cancel()  # a client that went away frees its row (no effect once done)
                    await queue.put(None)

            tasks = [asyncio.create_task(pump(pi * req.n + j, h, echoed[pi]))
                     for pi, g in enumerate(groups) for j, h in enumerate(g)]
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
                    yield f"data: {json.dumps(wrap(shape.chunk_object, [], usage(sum(counts))))}\n\n"
            finally:
                for t in tasks:
                    t.cancel()
                for h in handles:
                    h.cancel()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def checked(req, prompt_param: str):
        return with_choices(check_submit(req, cfg.vocab_size, engine.max_loops, cfg.max_seq_len, prompt_param), cfg)

    async def completions(request):
        return await serve(request, lambda body: checked(parse(body, tokenizer, model_name, eos), "prompt"),
                           TextShape)

    async def chat_completions(request):
        return await serve(request, lambda body: checked(parse_chat(body, tokenizer, model_name, eos,
                                                                    cfg.max_seq_len), "messages"), ChatShape)

    async def answer(request, respond) -> JSONResponse:
        """A JSON body -> respond(body) -> 200, or 400 naming the field."""
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        try:
            return JSONResponse(respond(body))
        except BadRequest as e:
            return fail(400, str(e), "invalid_request_error", e.param)

    async def tokenize(request):
        return await answer(request, lambda body: tokenizer_api.tokenize(body, tokenizer, model_name,
                                                                         cfg.max_seq_len))

    async def detokenize(request):
        return await answer(request, lambda body: tokenizer_api.detokenize(body, tokenizer, model_name,
                                                                           cfg.vocab_size))

    async def tokenizer_info(request):
        return JSONResponse(tokenizer_api.tokenizer_info(tokenizer, cfg.max_seq_len))

    async def models(request):
        return JSONResponse(dict(object="list", data=[dict(id=model_name, object="model", created=created,
                                                           owned_by="tinyloop", max_model_len=cfg.max_seq_len,
                                                           loops=cfg.default_loops)]))

    async def health(request):
        return JSONResponse(dict(status="ok", warming=engine.warming))

    async def metrics(request):
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        registry.register(_Collector(engine))
        return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request, exc):
        return fail(404, f"no route {request.method} {request.url.path}", "not_found_error")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
                             Route("/tokenize", tokenize, methods=["POST"]),
                             Route("/detokenize", detokenize, methods=["POST"]),
                             Route("/tokenizer_info", tokenizer_info)],
                     exception_handlers={404: not_found, 405: not_found},
                     middleware=edge.middleware(api_key, cors_origins, max_body))


async def _nothing():
    return
    yield


def mean_logprob(scores, start: int) -> float:
    """Mean log-probability of the tokens from `start` on (0 if there are none)."""
    lp = scores.logprobs[start:]
    return float(lp.mean()) if len(lp) else 0.0


class _Collector:
    """The engine's counters as Prometheus metric families."""

    COUNTERS = dict(requests="requests submitted", requests_rejected="requests refused (queue full)",
                    requests_failed="requests failed", tokens_in="prompt tokens received",
                    tokens_out="tokens emitted", prefix_tokens_reused="prompt tokens read from cached prefixes",
                    requests_prefix_hit="requests that reused a cached prefix",
                    requests_prefix_miss="requests with no cached prefix", prefill_chunks="prompt chunks run",
                    decode_steps="batched decode steps", batch_rows="rows decoded, summed over steps",
                    compiles_after_warmup="programs compiled after warmup",
                    lanes_evicted="idle depths evicted to stay within the memory budget")
    GAUGES = dict(queue_depth="requests waiting", running="requests in the batch",
                  mean_batch_size="rows per decode step (mean)", prefix_hit_rate="share of requests with a prefix hit",
                  ttft_p50_s="time to first token, median of recent requests (s)",
                  ttft_p99_s="time to first token, p99 of recent requests (s)",
                  tokens_per_second="tokens emitted per second since start",
                  lanes="depths held now (each a page pool, request rows and programs)",
                  memory_bytes="bytes the depths' page pools and request rows hold (within the memory budget)")

    # per depth (label `loops`), in tokens, as vLLM names its prefix-cache counters
    DEPTH_COUNTERS = dict(prefix_cache_queries="prompt tokens looked up in cached prefixes",
                          prefix_cache_hits="prompt tokens found in cached prefixes (read, not computed)",
                          tokens_computed="positions run through the model (prompt and decode)",
                          passes="loop passes run (positions x loops, less the passes adaptive exits skipped): "
                                 "passes / tokens = passes per token",
                          passes_skipped="loop passes skipped by adaptive-depth exits (exit_criterion)")

    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.engine.stats()
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"tinyloop_{name}", doc, value=s.get(name, 0))
        finished = CounterMetricFamily("tinyloop_requests_finished", "requests finished, by reason",
                                       labels=["reason"])
        for reason in ("stop", "length", "cancelled", "timeout", "error"):
            finished.add_metric([reason], s.get(f"finished_{reason}", 0))
        yield finished
        for name, doc in self.GAUGES.items():
            yield GaugeMetricFamily(f"tinyloop_{name}", doc, value=s.get(name, 0))
        for name, doc in self.DEPTH_COUNTERS.items():
            family = CounterMetricFamily(f"tinyloop_{name}", doc, labels=["loops"])
            for loops, counts in sorted(s.get("depths", {}).items()):
                family.add_metric([str(loops)], counts.get(name, 0))
            yield family


def eos_ids(path: str | None, tokenizer, vocab_size: int) -> list[int]:
    """The model's end-of-text ids: the tokenizer's end-of-turn ids (a GGUF's or a Hugging Face
    folder's), else a folder's eos_token_id (generation_config.json, else config.json), else the
    byte tokenizer's EOS."""
    from ..formats.tokenizer import ByteTokenizer

    if getattr(tokenizer, "eos_token_ids", None):
        return [int(x) for x in tokenizer.eos_token_ids if 0 <= int(x) < vocab_size]

    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name) if path else None
        if file and os.path.isfile(file):
            with open(file) as f:
                v = json.load(f).get("eos_token_id")
            if v is not None:
                return [int(x) for x in (v if isinstance(v, list) else [v]) if 0 <= int(x) < vocab_size]
    if isinstance(tokenizer, ByteTokenizer) and ByteTokenizer.EOS < vocab_size:
        return [ByteTokenizer.EOS]
    return []
