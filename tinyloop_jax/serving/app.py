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

import json
import os
import time
from dataclasses import dataclass

from . import edge, render, tokenizer_api
from .engine import Engine
from .handles import MemoryBudgetError, QueueFull, ReplicaUnavailable
from .metrics import Collector
from .protocol import BadRequest, ChatShape, TextShape, check_submit, error_body, parse, parse_chat, with_choices
from .tools import with_grammar


@dataclass(frozen=True)
class Server:
    """What every handler reads (`request.app.state.server`): the engine and how it is named."""

    engine: Engine
    tokenizer: object
    model_name: str
    eos: list
    created: int

    @property
    def cfg(self):
        return self.engine.model.weights.config

    def checked(self, req, prompt_param: str):
        """A parsed body's values checked against the model, one checked `Request` per choice."""
        c = self.cfg
        req = with_grammar(req, self.tokenizer, c.vocab_size)
        return with_choices(check_submit(req, c.vocab_size, self.engine.max_loops, c.max_seq_len, prompt_param), c)


def make_app(engine: Engine, tokenizer, model_name: str = "tinyloop", eos: list[int] = (), *,
             api_key: str | None = None, cors_origins=(), max_body: int = 4 << 20):
    """The ASGI app over a running engine. api_key: the Bearer key every route but /health and
    /metrics needs (None: open); cors_origins: the browser origins allowed (none by default);
    max_body: the largest request body in bytes."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                            Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics),
                            Route("/tokenize", tokenize, methods=["POST"]),
                            Route("/detokenize", detokenize, methods=["POST"]),
                            Route("/tokenizer_info", tokenizer_info)],
                    exception_handlers={404: not_found, 405: not_found},
                    middleware=edge.middleware(api_key, cors_origins, max_body))
    app.state.server = Server(engine, tokenizer, model_name, list(eos), int(time.time()))
    return app


# ---- the completion routes: parse, fan out, render ----------------------------------------------

def _fail(status: int, message: str, kind: str, param=None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(message, kind, param), status_code=status)


async def _serve(request, parse_body, shape):
    """One request: its body parsed and checked (each choice a `Request`), its choices submitted
    (`render.fan_out`), then the whole answer or a stream of chunks (`render`)."""
    from starlette.responses import JSONResponse, StreamingResponse

    s: Server = request.app.state.server
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        return _fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
    try:
        req = parse_body(s, body)
        groups = await render.fan_out(s.engine, req)
    except QueueFull as e:
        return _fail(429, str(e), "rate_limit_error")
    except ReplicaUnavailable as e:  # (a RuntimeError) several engines: the one it went to failed
        return _fail(503, str(e), "service_unavailable")
    except MemoryBudgetError as e:  # (a RuntimeError) this request can never fit, whatever waits
        return _fail(400, str(e), "invalid_request_error")
    except BadRequest as e:
        return _fail(400, str(e), "invalid_request_error", e.param)
    except (ValueError, RuntimeError) as e:
        return _fail(400, str(e), "invalid_request_error")
    reply = render.Reply(s, req, groups, shape)
    if req.stream:
        return StreamingResponse(render.events(reply), media_type="text/event-stream")
    status, out = await render.whole(reply)
    return JSONResponse(out, status_code=status)


async def completions(request):
    return await _serve(request, lambda s, body: s.checked(parse(body, s.tokenizer, s.model_name, s.eos), "prompt"),
                        TextShape)


async def chat_completions(request):
    return await _serve(request, lambda s, body: s.checked(parse_chat(body, s.tokenizer, s.model_name, s.eos,
                                                                      s.cfg.max_seq_len), "messages"), ChatShape)


# ---- the other routes --------------------------------------------------------------------------

async def _answer(request, respond):
    """A JSON body -> respond(server, body) -> 200, or 400 naming the field."""
    from starlette.responses import JSONResponse

    try:
        body = json.loads(await request.body())
    except ValueError as e:
        return _fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
    try:
        return JSONResponse(respond(request.app.state.server, body))
    except BadRequest as e:
        return _fail(400, str(e), "invalid_request_error", e.param)


async def tokenize(request):
    return await _answer(request, lambda s, body: tokenizer_api.tokenize(body, s.tokenizer, s.model_name,
                                                                         s.cfg.max_seq_len))


async def detokenize(request):
    return await _answer(request, lambda s, body: tokenizer_api.detokenize(body, s.tokenizer, s.model_name,
                                                                           s.cfg.vocab_size))


async def tokenizer_info(request):
    from starlette.responses import JSONResponse

    s = request.app.state.server
    return JSONResponse(tokenizer_api.tokenizer_info(s.tokenizer, s.cfg.max_seq_len))


async def models(request):
    from starlette.responses import JSONResponse

    s = request.app.state.server
    return JSONResponse(dict(object="list", data=[dict(id=s.model_name, object="model", created=s.created,
                                                       owned_by="tinyloop", max_model_len=s.cfg.max_seq_len,
                                                       loops=s.cfg.default_loops)]))


async def health(request):
    """200 `{"status": "ok"}` once ready; 503 `{"status": "warming"}` while the programs still
    compile (requests are served meanwhile, compiling what they need first): a load balancer's
    or Kubernetes' readiness probe sends traffic once it is 200, as llama.cpp's while loading.
    503 `{"status": "stalled", "reason": ...}` once the engine no longer serves (`Engine.stalled`):
    a liveness probe's cue to restart the server."""
    from starlette.responses import JSONResponse

    engine = request.app.state.server.engine
    stalled = engine.stalled()
    if stalled:
        return JSONResponse(dict(status="stalled", warming=False, reason=stalled), status_code=503)
    warming = engine.warming
    return JSONResponse(dict(status="warming" if warming else "ok", warming=warming),
                        status_code=503 if warming else 200)


async def metrics(request):
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from starlette.responses import PlainTextResponse

    registry = CollectorRegistry()
    registry.register(Collector(request.app.state.server.engine))
    return PlainTextResponse(generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)


async def not_found(request, exc):
    return _fail(404, f"no route {request.method} {request.url.path}", "not_found_error")


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
