"""`tinyloop serve`: an OpenAI-compatible HTTP API over the `Engine` (Starlette + uvicorn, the
`serve` extra).

    POST /v1/completions    prompt (text or token ids), max_tokens, temperature, top_p, stop,
                            seed, stream (server-sent events), n = 1; extras top_k,
                            repetition_penalty, loops, ignore_eos. Each choice also carries
                            token_ids (the emitted ids) and finish_reason "stop" | "length".
    GET  /v1/models   /health   /metrics (Prometheus text)

Bad requests get HTTP 400 with an OpenAI-style error body; a full queue 429; a request past its
deadline 504. The server has no authentication of its own: it binds to 127.0.0.1 unless told
otherwise, and anything wider belongs behind a reverse proxy that authenticates.
"""

from __future__ import annotations

import json
import numbers
import os
import secrets
import time
from contextlib import aclosing

from .engine import Engine
from .handles import QueueFull, RequestTimeout


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---- text --------------------------------------------------------------------------------------

class Detokenizer:
    """Emitted ids -> text as it becomes final: held back while it ends in a partial character
    (U+FFFD) or could be the start of a stop string; cut before the first stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self, ids) -> str:
        text = self.tok.decode(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return text[:min(hits)]
        return text

    def _delta(self, text: str, final: bool) -> str:
        if not (final or self.stopped):
            text = text.rstrip("\ufffd")
            text = text[:max(len(self.sent), len(text) - self.hold)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def add(self, ids: list[int]) -> str:
        """More ids -> the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        self.ids += ids
        return self._delta(self._text(self.ids), final=False)

    def finish(self, drop: int = 0) -> str:
        """The rest of the text once generation ended (the last `drop` ids, a stop token
        sequence, are not text)."""
        if self.stopped:
            return ""
        return self._delta(self._text(self.ids[:len(self.ids) - drop]), final=True)


# ---- request parsing ---------------------------------------------------------------------------

def _int(body: dict, name: str, default):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    return int(v)


def _num(body: dict, name: str, default):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise BadRequest(f"{name} must be a number, got {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be true or false, got {v!r}", name)
    return v


def parse_prompt(prompt, tokenizer) -> list[int]:
    """A string (the model's tokenizer), a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt).tolist()
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request: n = 1 and a single prompt are supported", "prompt")
    raise BadRequest(f"prompt must be a string or a list of token ids, got {json.dumps(prompt)[:80]}", "prompt")


def parse_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    return stop


def parse(body, tokenizer, model_name: str, eos: list[int]) -> tuple[dict, list[str], bool, dict]:
    """A completions request body -> (engine.submit arguments, stop strings, stream, options)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    model = body.get("model", model_name)
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    if _int(body, "n", 1) != 1 or _int(body, "best_of", 1) != 1:
        raise BadRequest("only n = 1 (and best_of = 1) is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, 0.0) != 0.0:
            raise BadRequest(f"{name} is not supported (use repetition_penalty)", name)
    if body.get("logprobs") is not None or _bool(body, "echo", False) or body.get("logit_bias"):
        raise BadRequest("logprobs, echo and logit_bias are not supported", "logprobs")
    seed = _int(body, "seed", None)
    kw = dict(prompt=parse_prompt(body["prompt"], tokenizer), max_tokens=_int(body, "max_tokens", 16),
              temperature=_num(body, "temperature", 1.0), top_p=_num(body, "top_p", 1.0),
              top_k=_int(body, "top_k", 0), repetition_penalty=_num(body, "repetition_penalty", 1.0),
              seed=secrets.randbits(32) if seed is None else seed, loops=_int(body, "loops", None))
    if not _bool(body, "ignore_eos", False):
        kw["stop_sequences"] = [[e] for e in eos]
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return kw, parse_stop(body.get("stop")), _bool(body, "stream", False), opts


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- the app -----------------------------------------------------------------------------------

def make_app(engine: Engine, tokenizer, model_name: str = "tinyloop", eos: list[int] = ()):
    """The ASGI app over a running engine."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    cfg = engine.model.weights.config
    eos = list(eos)
    created = int(time.time())

    def fail(status: int, message: str, kind: str, param=None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param), status_code=status)

    async def completions(request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return fail(400, f"the request body is not valid JSON: {e}", "invalid_request_error")
        try:
            kw, stops, stream, opts = parse(body, tokenizer, model_name, eos)
            handle = engine.submit(**kw)
        except QueueFull as e:
            return fail(429, str(e), "rate_limit_error")
        except BadRequest as e:
            return fail(400, str(e), "invalid_request_error", e.param)
        except (ValueError, RuntimeError) as e:
            return fail(400, str(e), "invalid_request_error")
        rid = f"cmpl-{handle.id}-{secrets.token_hex(6)}"
        text = Detokenizer(tokenizer, stops)

        def chunk(delta: str, ids: list[int], finish=None, usage=None) -> dict:
            out = dict(id=rid, object="text_completion", created=int(time.time()), model=model_name,
                       choices=[dict(index=0, text=delta, logprobs=None, finish_reason=finish, token_ids=ids)])
            if usage is not None:
                out["usage"] = usage
            return out

        def usage() -> dict:  # the tokens up to a stop string (the engine may have run one step on)
            n = len(text.ids)
            return dict(prompt_tokens=len(handle.prompt), completion_tokens=n, total_tokens=len(handle.prompt) + n)

        def reason() -> str:
            return "stop" if text.stopped or handle.finish_reason == "stop" else "length"

        def tail() -> str:
            return text.finish(len(handle.stop_matched or ()))

        if not stream:
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
            out = chunk(text.sent + tail(), list(text.ids), reason(), usage())
            return JSONResponse(out)

        async def events():
            try:
                async with aclosing(handle.astream()) as tokens:
                    async for t in tokens:
                        delta = text.add([t])
                        yield f"data: {json.dumps(chunk(delta, [t]))}\n\n"
                        if text.stopped:
                            handle.cancel()
                            break
                yield f"data: {json.dumps(chunk(tail(), [], reason()))}\n\n"
                if opts.get("include_usage"):
                    last = dict(id=rid, object="text_completion", created=int(time.time()), model=model_name,
                                choices=[], usage=usage())
                    yield f"data: {json.dumps(last)}\n\n"
            except RuntimeError as e:  # a deadline or a failed step, after the headers went out
                yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
            finally:
                handle.cancel()  # a client that went away frees its row (no effect once done)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

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
                             Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)],
                     exception_handlers={404: not_found, 405: not_found})


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


def eos_ids(path: str | None, tokenizer, vocab_size: int) -> list[int]:
    """The model's end-of-text ids: a folder's eos_token_id (config.json, else
    generation_config.json), or the byte tokenizer's EOS."""
    from ..formats.tokenizer import ByteTokenizer

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
