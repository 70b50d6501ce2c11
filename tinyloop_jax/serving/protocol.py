"""The OpenAI protocol of `tinyloop serve`: request bodies checked into `Engine.submit` arguments
(`parse` for /v1/completions, `parse_chat` for /v1/chat/completions, sharing `parse_common`;
`parse_penalties` for OpenAI's presence_penalty, frequency_penalty and logit_bias; then
`check_submit`, the engine's own checks run at the edge), and the shapes of the response objects
(`TextShape`, `ChatShape`). Bad input raises `BadRequest` naming the field (the server's HTTP 400),
so no value a client sends gets as far as a 500.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import secrets

from ..api import validation as check
from ..api import request as R
from ..decoding.sampling import MAX_LOGIT_BIAS



from . import tools as T
from .handles import BadRequest
from .messages import parse_messages


# ---- request parsing ---------------------------------------------------------------------------

def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    """body[name] as an int (default if absent), in [lo, hi) when given."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise BadRequest(f"{name} must be an integer, got {v!r}", name)
    if lo is not None and v < lo or hi is not None and v >= hi:
        raise BadRequest(f"{name} must be in [{lo}, {hi}), got {v}", name)
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


def parse_prompts(prompt, tokenizer) -> list[list[int]]:
    """OpenAI's completions `prompt`: a string, a list of token ids, or a list of several of
    those (each its own choices) -> one id list per prompt."""
    def one(p, where: str) -> list[int]:
        if isinstance(p, str):
            return tokenizer.encode(p).tolist()
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise BadRequest(f"{where} must be a string or a non-empty list of token ids, got {json.dumps(p)[:80]}",
                         "prompt")

    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise BadRequest(f"prompt holds {len(prompt)} prompts; at most {MAX_CHOICES} per request", "prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]


def parse_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    return stop


# choices one request may ask for (prompts x best_of): each is a row of the engine's batch
MAX_CHOICES = 128
# log-probabilities of the top tokens a request may ask for per position (OpenAI's limit)
MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A request body, checked: the `engine.submit` arguments (but the prompt and seed, which
    each choice has its own) and what the response needs."""
    submit: dict
    prompts: list[list[int]]  # one or more prompts, each with n choices
    seed: int  # choice j of a prompt samples with `choice_seed(seed, j)`
    stops: list[str]  # stop strings (checked on the text)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    n: int = 1  # choices returned per prompt
    best_of: int = 1  # candidates generated per prompt; the n likeliest (per token) are returned
    logprobs: int | None = None  # top log-probabilities per token (None: no logprobs object)
    echo: bool = False  # the prompt's text (and logprobs) start each choice
    format: tuple | None = None  # structured output: (OpenAI's response_format dict, the field that named it)
    tools: T.Tools | None = None  # a chat's tools (`tools.parse`); its answer is read for calls

    choices: tuple = ()  # per prompt, its best_of checked `Request`s (`with_choices`); None: echo only

    def request(self, prompt, j: int) -> R.Request:
        """Choice j of `prompt` as the engine's `Request` (not yet checked): sampling seeded
        `choice_seed(seed, j)`."""
        return R.from_keywords(prompt, **dict(self.submit, seed=choice_seed(self.seed, j)))


def choice_seed(seed: int, j: int) -> int:
    """Choice j's sampling seed: choice 0 samples as a request with n = 1 and the same seed."""
    if j == 0:
        return seed
    import numpy as np
    return int(np.random.SeedSequence([seed, j]).generate_state(1)[0])


def parse_common(body, model_name: str, eos: list[int], prompts: list[list[int]], max_tokens: int,
                 logprobs: int | None = None, echo: bool = False) -> Parsed:
    """What completions and chat completions share: model, n / best_of, sampling knobs, OpenAI's
    penalties and logit_bias, stop, stream, and the extras (top_k, repetition_penalty, loops,
    ignore_eos, the adaptive-depth knobs, cache_window, draft_loops / lookahead)."""
    model = body.get("model", model_name)
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    n = _int(body, "n", 1)
    best_of = _int(body, "best_of", n)
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n must be in [1, {MAX_CHOICES}], got {n}", "n")
    if not n <= best_of <= MAX_CHOICES:
        raise BadRequest(f"best_of must be in [n={n}, {MAX_CHOICES}], got {best_of}", "best_of")
    if len(prompts) * best_of > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x best_of {best_of} is more than {MAX_CHOICES} choices", "best_of")
    stream = _bool(body, "stream", False)
    if stream and logprobs is not None:
        raise BadRequest("logprobs are computed once a choice is complete: not with stream", "logprobs")
    if stream and best_of > n:
        raise BadRequest("best_of > n picks among complete choices: not with stream", "best_of")
    if max_tokens == 0 and not echo:
        raise BadRequest("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    seed = _int(body, "seed", None)
    kw = dict(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0),
              top_p=_num(body, "top_p", 1.0), top_k=_int(body, "top_k", 0),
              repetition_penalty=_num(body, "repetition_penalty", 1.0), loops=_int(body, "loops", None),
              **parse_penalties(body))
    if not _bool(body, "ignore_eos", False):
        kw["stop_sequences"] = [[e] for e in eos]
    kw.update(parse_adaptive(body))
    if body.get("cache_window") is not None:  # an extra: sliding-window attention, as generate's
        kw["cache_window"] = _int(body, "cache_window", None)
    if body.get("draft_loops") is not None:  # extras: self-speculative decoding, as generate's
        kw["draft_loops"] = _int(body, "draft_loops", None)
        kw["lookahead"] = _int(body, "lookahead", 4)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return Parsed(kw, prompts, secrets.randbits(32) if seed is None else seed, parse_stop(body.get("stop")), stream,
                  _bool(opts, "include_usage", False), n, best_of, logprobs, echo, T.parse_format(body))


def parse_adaptive(body: dict) -> dict:
    """The adaptive-depth extras (`Engine.submit`'s exit_criterion, exit_threshold, min_steps,
    check_every, continuous_compute), those the body names; their values are checked against
    the model by `with_choices`."""
    kw = {}
    if body.get("exit_criterion") is not None:
        if not isinstance(body["exit_criterion"], str):
            raise BadRequest(f"exit_criterion must be a string, got {body['exit_criterion']!r}", "exit_criterion")
        kw["exit_criterion"] = body["exit_criterion"]
    for name, read in (("exit_threshold", _num), ("min_steps", _int), ("check_every", _int),
                       ("continuous_compute", _bool), ("exit_in_prefill", _bool)):
        if body.get(name) is not None:
            kw[name] = read(body, name, None)
    return kw


# the request's fields, longest first: the first one an error message names is its param
_FIELDS = sorted(R.KEYWORDS, key=len, reverse=True)


def with_choices(req: Parsed, cfg) -> Parsed:
    """`req` with every prompt's best_of choices built and checked against the model once
    (`request.checked`: the plan resolved, an adaptive policy built), what the engine takes as
    is; a failure is a BadRequest naming the field. max_tokens 0 (echo only): no choices."""
    if req.submit["max_tokens"] == 0:
        return dataclasses.replace(req, choices=tuple((None,) * req.best_of for _ in req.prompts))
    try:
        return dataclasses.replace(req, choices=tuple(tuple(R.checked(req.request(p, j), cfg)
                                                            for j in range(req.best_of)) for p in req.prompts))
    except ValueError as e:
        raise BadRequest(str(e), next((k for k in _FIELDS if k in str(e)), None)) from None


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def _logprobs(body: dict, name: str) -> int | None:
    k = _int(body, name, None)
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}", name)
    return k


def parse(body, tokenizer, model_name: str, eos: list[int]) -> Parsed:
    """A /v1/completions request body (default max_tokens 16, as OpenAI's)."""
    body = _object(body)
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    logprobs = None if body.get("logprobs") is False else _logprobs(body, "logprobs")
    return parse_common(body, model_name, eos, parse_prompts(body["prompt"], tokenizer), _int(body, "max_tokens", 16),
                        logprobs, _bool(body, "echo", False))


# A chat request without max_tokens may answer up to this many tokens (or to the end of the
# context): OpenAI's default is the context, which would size every row for the whole context.
CHAT_MAX_TOKENS = 1024


def parse_chat(body, tokenizer, model_name: str, eos: list[int], context: int) -> Parsed:
    """A /v1/chat/completions request body (`max_completion_tokens`, else `max_tokens`)."""
    body = _object(body)
    tools = T.parse(body)
    forced = T.forced_format(tools)
    if forced is not None and (body.get("response_format") or body.get("structured_outputs")) not in (
            None, {"type": "text"}):
        raise BadRequest("tool_choice required / a named function is its own response format: not with "
                         "response_format", "tool_choice")
    prompt = parse_messages(body.get("messages"), tokenizer, tools=tools)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1, 2**31)  # checked here: the engine knows it as max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(CHAT_MAX_TOKENS, context - len(prompt)))
    top = _logprobs(body, "top_logprobs")
    if top is not None and not _bool(body, "logprobs", False):
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if _bool(body, "logprobs", False) else None
    req = parse_common(body, model_name, eos, [prompt], max_tokens, logprobs)
    return dataclasses.replace(req, tools=tools, format=(forced, "tool_choice") if forced else req.format)


def parse_penalties(body: dict) -> dict:
    """OpenAI's presence_penalty and frequency_penalty (numbers in [-2, 2], default 0) and
    logit_bias (a JSON object of token-id strings -> numbers in [-100, 100], at most 300 entries)
    -> `Engine.submit` keywords. Whether each id is in the vocabulary is `check_submit`'s."""
    out = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = _num(body, name, 0.0)
        if not -2.0 <= v <= 2.0:  # (NaN fails this too)
            raise BadRequest(f"{name} must be in [-2, 2], got {v}", name)
        out[name] = v
    bias = body.get("logit_bias")
    if bias is None:
        return out
    if not isinstance(bias, dict):
        raise BadRequest(f"logit_bias must be an object of token ids to biases, got {json.dumps(bias)[:80]}",
                         "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", "logit_bias")
    out["logit_bias"] = {}
    for key, v in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -100.0 <= v <= 100.0:
            raise BadRequest(f"logit_bias[{key!r}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        out["logit_bias"][int(key)] = float(v)
    return out


def _named(param: str, check_value, *args):
    """check_value(*args), its ValueError a BadRequest naming `param`."""
    try:
        return check_value(*args)
    except ValueError as e:
        raise BadRequest(str(e), param) from None


# Engine.submit's keyword -> the engine's own check of it (api/validation)
_SUBMIT_CHECKS = dict(max_tokens=check.max_tokens, temperature=check.temperature, top_k=check.top_k,
                      cache_window=check.cache_window,
                      top_p=check.top_p, repetition_penalty=check.repetition_penalty, seed=check.seed,
                      presence_penalty=lambda v: check.penalty(v, "presence_penalty"),
                      frequency_penalty=lambda v: check.penalty(v, "frequency_penalty"))


def check_submit(req: Parsed, vocab_size: int, max_loops: int, context: int, prompt_param: str = "prompt") -> Parsed:
    """`Engine.submit`'s checks of a parsed request, run at the edge, where the request's field
    names are known (the engine runs them again): each value in its range (NaN and infinities
    refused), prompt and logit_bias ids in the vocabulary, loops up to the engine's max_loops,
    each prompt + max_tokens within the context. A failure is a BadRequest naming the field
    (`prompt_param`: "messages" for a chat, whose prompt the template wrote)."""
    kw = req.submit
    for name, check_value in _SUBMIT_CHECKS.items():
        if name in kw and not (name == "max_tokens" and kw[name] == 0 and req.echo):  # 0: echo only
            _named(name, check_value, kw[name])
    _named("seed", check.seed, req.seed)
    _named("logit_bias", check.logit_bias, kw.get("logit_bias"), vocab_size)
    if kw.get("loops") is not None:
        if _named("loops", check.loops, kw["loops"]) > max_loops:
            raise BadRequest(f"loops={kw['loops']} is above this server's max_loops={max_loops}", "loops")
    for i, p in enumerate(req.prompts):
        name = prompt_param if len(req.prompts) == 1 else f"{prompt_param}[{i}]"
        prompt = _named(prompt_param, check.tokens, p, vocab_size)
        if len(prompt) >= context and not (req.echo and kw["max_tokens"] == 0):  # no max_tokens would help
            raise BadRequest(f"the prompt ({name}) is {len(prompt)} tokens; the model's context is {context} "
                             "(max_seq_len), with room for at least one token to generate", prompt_param)
        n = len(prompt) + kw["max_tokens"]
        if n > context:
            raise BadRequest(f"prompt + max_tokens is {n} tokens ({name}), longer than the model's context of "
                             f"{context} (max_seq_len)", "max_tokens")
    return req


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- response shapes ---------------------------------------------------------------------------

def completion_logprobs(tokenizer, ids: list[int], scores, start: int, offset: int = 0) -> dict:
    """OpenAI's legacy `logprobs` object for tokens ids[start:] (ids: prompt + completion,
    `scores`: `Model.score` of them): tokens, token_logprobs, top_logprobs ({token: logprob}: the
    top ones and the token itself, as vLLM), text_offset (from `offset`). Entry 0 of a sequence
    (nothing predicts it) is None."""
    tokens = [tokenizer.token_text(t) for t in ids[start:]]
    chosen, top = [], []
    for i in range(start, len(ids)):
        if i == 0:
            chosen.append(None), top.append(None)
            continue
        entry = {tokenizer.token_text(t): float(v) for t, v in zip(scores.top_ids[i], scores.top_logprobs[i])}
        entry.setdefault(tokens[i - start], float(scores.logprobs[i]))
        chosen.append(float(scores.logprobs[i])), top.append(entry)
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return dict(tokens=tokens, token_logprobs=chosen, top_logprobs=top, text_offset=offsets)


def chat_logprobs(tokenizer, ids: list[int], scores, start: int) -> dict:
    """OpenAI's chat `logprobs` object ({"content": [...]}) for tokens ids[start:]."""
    def entry(t: int, v: float) -> dict:
        text = tokenizer.token_text(t)
        return dict(token=text, logprob=float(v), bytes=list(text.encode("utf-8")))

    return dict(content=[dict(**entry(ids[i], scores.logprobs[i]),
                              top_logprobs=[entry(t, v) for t, v in zip(scores.top_ids[i], scores.top_logprobs[i])])
                         for i in range(max(start, 1), len(ids))])


class TextShape:
    """OpenAI's completion objects: each choice (and each streamed chunk's) carries `text`."""
    id_prefix, full_object, chunk_object = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(index: int, text: str, ids: list[int], finish: str | None, streaming: bool,
               logprobs: dict | None = None) -> dict:
        return dict(index=index, text=text, logprobs=logprobs, finish_reason=finish, token_ids=ids)

    @staticmethod
    def opening(index: int) -> dict | None:
        return None


class ChatShape:
    """OpenAI's chat objects: the answer is a `message`; streamed chunks carry a `delta`, the
    first one the role."""
    id_prefix, full_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(index: int, text: str, ids: list[int], finish: str | None, streaming: bool,
               logprobs: dict | None = None) -> dict:
        if streaming:
            delta = dict(content=text) if text or finish is None else {}
            return dict(index=index, delta=delta, logprobs=logprobs, finish_reason=finish, token_ids=ids)
        return dict(index=index, message=dict(role="assistant", content=text), logprobs=logprobs,
                    finish_reason=finish, token_ids=ids)

    @staticmethod
    def opening(index: int) -> dict | None:
        return dict(index=index, delta=dict(role="assistant", content=""), logprobs=None, finish_reason=None)

    @staticmethod
    def calls(index: int, calls: list, ids: list[int], streaming: bool, logprobs: dict | None = None) -> dict:
        """A choice whose answer is tool calls (`tools.calls_in`): finish_reason "tool_calls"."""
        if streaming:
            return dict(index=index, delta=dict(tool_calls=[dict(c, index=i) for i, c in enumerate(calls)]),
                        logprobs=logprobs, finish_reason="tool_calls", token_ids=ids)
        return dict(index=index, message=dict(role="assistant", content=None, tool_calls=calls), logprobs=logprobs,
                    finish_reason="tool_calls", token_ids=ids)
