"""`tinyloop serve`: an OpenAI-compatible HTTP API over the `Engine` (Starlette + uvicorn, the
`serve` extra).

    POST /v1/completions    prompt (text or token ids), max_tokens, temperature, top_p, stop,
                            seed, stream (server-sent events), n = 1; extras top_k,
                            repetition_penalty, loops, ignore_eos. Each choice also carries
                            token_ids (the emitted ids) and finish_reason "stop" | "length".
    POST /v1/chat/completions  messages (system / user / assistant, string content) through the
                            model's chat template; max_completion_tokens (or max_tokens) and the
                            rest as above. The answer stops at the template's end-of-turn ids,
                            which are not part of message.content; streamed chunks carry deltas,
                            the first one the role. A model with no chat template: HTTP 400.
    GET  /v1/models   /health   /metrics (Prometheus text; per-depth counters labelled `loops`)
    POST /tokenize  POST /detokenize  GET /tokenizer_info   vLLM's tokenizer routes (`tokenizer_api`)

OpenAI's presence_penalty, frequency_penalty and logit_bias are taken by both completion routes.
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

import json
import os
import secrets
import time
from contextlib import aclosing

from . import edge, tokenizer_api
from .engine import Engine
from .handles import MemoryBudgetError, QueueFull, RequestTimeout
from .protocol import BadRequest, ChatShape, TextShape, check_submit, error_body, parse, parse_chat
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

    async def serve(request, parse_body, shape):
        """One request: parse, submit, then the whole answer or a stream of chunks."""
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        try:
            req = parse_body(body)
            handle = engine.submit(**req.submit)
        except QueueFull as e:
            return fail(429, str(e), "rate_limit_error")
        except MemoryBudgetError as e:  # (a RuntimeError) this request can never fit, whatever waits
            return fail(400, str(e), "invalid_request_error")
        except BadRequest as e:
            return fail(400, str(e), "invalid_request_error", e.param)
        except (ValueError, RuntimeError) as e:
            return fail(400, str(e), "invalid_request_error")
        rid = f"{shape.id_prefix}-{handle.id}-{secrets.token_hex(6)}"
        text = Detokenizer(tokenizer, req.stops)

        def wrap(obj: str, choices: list, usage=None) -> dict:
            out = dict(id=rid, object=obj, created=int(time.time()), model=model_name, choices=choices)
            if usage is not None:
                out["usage"] = usage
            return out

        def chunk(delta: str, ids: list[int], finish=None) -> dict:
            return wrap(shape.chunk_object, [shape.choice(delta, ids, finish, streaming=True)])

        def usage() -> dict:  # the tokens up to a stop string (the engine may have run one step on)
            n, p = len(text.ids), len(handle.prompt)
            return dict(prompt_tokens=p, completion_tokens=n, total_tokens=p + n,
                        prompt_tokens_details=dict(cached_tokens=handle.prefix_tokens))

        def reason() -> str:
            return "stop" if text.stopped or handle.finish_reason == "stop" else "length"

        def tail() -> str:
            return text.finish(len(handle.stop_matched or ()))

        if not req.stream:
            try:
                async with aclosing(handle.astream()) as tokens:
                    async for t in tokens:
                        text.add([t])
                        if text.stopped:
                            handle.cancel()
                            break
            except RequestTimeout as e:
                return fail(504, str(e), "timeout")
            except RuntimeError as e:
                return fail(500, str(e), "server_error")
            choice = shape.choice(text.sent + tail(), list(text.ids), reason(), streaming=False)
            return JSONResponse(wrap(shape.full_object, [choice], usage()))

        async def events():
            try:
                if shape.opening() is not None:
                    yield f"data: {json.dumps(wrap(shape.chunk_object, [shape.opening()]))}\n\n"
                async with aclosing(handle.astream()) as tokens:
                    async for t in tokens:
                        delta = text.add([t])
                        yield f"data: {json.dumps(chunk(delta, [t]))}\n\n"
                        if text.stopped:
                            handle.cancel()
                            break
                yield f"data: {json.dumps(chunk(tail(), [], reason()))}\n\n"
                if req.include_usage:
                    yield f"data: {json.dumps(wrap(shape.chunk_object, [], usage()))}\n\n"
            except RuntimeError as e:  # a deadline or a failed step, after the headers went out
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            finally:
                handle.cancel()  # a client that went away frees its row (no effect once done)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def checked(req, prompt_param: str):
        return check_submit(req, cfg.vocab_size, engine.max_loops, cfg.max_seq_len, prompt_param)

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
        return JSONResponse(dict(status="ok"))

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


class _Collector:
    """The engine's counters as Prometheus metric families."""

    COUNTERS = dict(requests="requests submitted", requests_rejected="requests refused (queue full)",
                    requests_failed="requests failed", tokens_in="prompt tokens received",
                    tokens_out="tokens emitted", prefix_tokens_reused="prompt tokens read from cached prefixes",
                    requests_prefix_hit="requests that reused a cached prefix",
                    requests_prefix_miss="requests with no cached prefix", prefill_chunks="prompt chunks run",
                    decode_steps="batched decode steps", batch_rows="rows decoded, summed over steps",
                    compiles_after_warmup="programs compiled after warmup")
    GAUGES = dict(queue_depth="requests waiting", running="requests in the batch",
                  mean_batch_size="rows per decode step (mean)", prefix_hit_rate="share of requests with a prefix hit",
                  ttft_p50_s="time to first token, median of recent requests (s)",
                  ttft_p99_s="time to first token, p99 of recent requests (s)",
                  tokens_per_second="tokens emitted per second since start")

    # per depth (label `loops`), in tokens, as vLLM names its prefix-cache counters
    DEPTH_COUNTERS = dict(prefix_cache_queries="prompt tokens looked up in cached prefixes",
                          prefix_cache_hits="prompt tokens found in cached prefixes (read, not computed)",
                          tokens_computed="positions run through the model (prompt and decode)",
                          passes="loop passes run (positions x loops): passes / tokens = passes per token")

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
