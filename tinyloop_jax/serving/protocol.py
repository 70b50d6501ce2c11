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
from ..decoding.sampling import MAX_LOGIT_BIAS


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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


CHAT_ROLES = ("system", "user", "assistant")


def parse_messages(messages, tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """A chat's `messages` (system / user / assistant, string content; OpenAI's "developer" is
    "system") -> the prompt ids: the model's chat template with the assistant's generation prompt,
    encoded as transformers does (the template writes the special tokens; none are added)."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this model has no chat template, so it cannot serve /v1/chat/completions; "
                         "use /v1/completions, or serve an instruction-tuned model (e.g. --model smollm2)", "messages")
    if messages is None:
        raise BadRequest("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages must be a non-empty list of {{role, content}} objects, got "
                         f"{json.dumps(messages)[:80]}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content, got {json.dumps(m)[:80]}",
                             f"messages[{i}]")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(CHAT_ROLES)}",
                             f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            got = "missing" if m.get("content") is None else f"a {type(m['content']).__name__}"
            raise BadRequest(f"messages[{i}].content must be a string, got {got}", f"messages[{i}].content")
        out.append(dict(role=role, content=m["content"]))  # only role and content reach the template
    try:
        return tokenizer.apply_chat_template(out, add_generation_prompt=add_generation_prompt, tokenize=True).tolist()
    except ValueError as e:  # the template itself refused the conversation (raise_exception)
        raise BadRequest(str(e), "messages") from None


def parse_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    return stop


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A request body, checked: the `engine.submit` arguments and what the response needs."""
    submit: dict
    stops: list[str]  # stop strings (checked on the text)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def parse_common(body, model_name: str, eos: list[int], prompt: list[int], max_tokens: int) -> Parsed:
    """What completions and chat completions share: model, n, sampling knobs, OpenAI's penalties
    and logit_bias, the extras (top_k, repetition_penalty, loops, ignore_eos), stop, stream."""
    model = body.get("model", model_name)
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")
    if _int(body, "n", 1) != 1 or _int(body, "best_of", 1) != 1:
        raise BadRequest("only n = 1 (and best_of = 1) is supported", "n")
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        raise BadRequest("logprobs is not supported", "logprobs")
    seed = _int(body, "seed", None)
    kw = dict(prompt=prompt, max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0),
              top_p=_num(body, "top_p", 1.0), top_k=_int(body, "top_k", 0),
              repetition_penalty=_num(body, "repetition_penalty", 1.0),
              seed=secrets.randbits(32) if seed is None else seed, loops=_int(body, "loops", None),
              **parse_penalties(body))
    if not _bool(body, "ignore_eos", False):
        kw["stop_sequences"] = [[e] for e in eos]
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    return Parsed(kw, parse_stop(body.get("stop")), _bool(body, "stream", False), _bool(opts, "include_usage", False))


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse(body, tokenizer, model_name: str, eos: list[int]) -> Parsed:
    """A /v1/completions request body (default max_tokens 16, as OpenAI's)."""
    body = _object(body)
    if "prompt" not in body:
        raise BadRequest("prompt is required", "prompt")
    if _bool(body, "echo", False):
        raise BadRequest("echo is not supported", "echo")
    return parse_common(body, model_name, eos, parse_prompt(body["prompt"], tokenizer), _int(body, "max_tokens", 16))


# A chat request without max_tokens may answer up to this many tokens (or to the end of the
# context): OpenAI's default is the context, which would size every row for the whole context.
CHAT_MAX_TOKENS = 1024


def parse_chat(body, tokenizer, model_name: str, eos: list[int], context: int) -> Parsed:
    """A /v1/chat/completions request body (`max_completion_tokens`, else `max_tokens`)."""
    body = _object(body)
    for name in ("tools", "functions", "tool_choice", "response_format"):
        if body.get(name) not in (None, [], {"type": "text"}, "none"):
            raise BadRequest(f"{name} is not supported", name)
    prompt = parse_messages(body.get("messages"), tokenizer)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1, 2**31)  # checked here: the engine knows it as max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(CHAT_MAX_TOKENS, context - len(prompt)))
    return parse_common(body, model_name, eos, prompt, max_tokens)


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
                      top_p=check.top_p, repetition_penalty=check.repetition_penalty, seed=check.seed,
                      presence_penalty=lambda v: check.penalty(v, "presence_penalty"),
                      frequency_penalty=lambda v: check.penalty(v, "frequency_penalty"))


def check_submit(req: Parsed, vocab_size: int, max_loops: int, context: int, prompt_param: str = "prompt") -> Parsed:
    """`Engine.submit`'s checks of a parsed request, run at the edge, where the request's field
    names are known (the engine runs them again): each value in its range (NaN and infinities
    refused), prompt and logit_bias ids in the vocabulary, loops up to the engine's max_loops,
    prompt + max_tokens within the context. A failure is a BadRequest naming the field
    (`prompt_param`: "messages" for a chat, whose prompt the template wrote)."""
    kw = req.submit
    prompt = _named(prompt_param, check.tokens, kw["prompt"], vocab_size)
    for name, check_value in _SUBMIT_CHECKS.items():
        if name in kw:
            _named(name, check_value, kw[name])
    _named("logit_bias", check.logit_bias, kw.get("logit_bias"), vocab_size)
    if kw.get("loops") is not None:
        if _named("loops", check.loops, kw["loops"]) > max_loops:
            raise BadRequest(f"loops={kw['loops']} is above this server's max_loops={max_loops}", "loops")
    if len(prompt) >= context:  # no max_tokens would help
        raise BadRequest(f"the prompt ({prompt_param}) is {len(prompt)} tokens; the model's context is {context} "
                         "(max_seq_len), with room for at least one token to generate", prompt_param)
    n = len(prompt) + kw["max_tokens"]
    if n > context:
        raise BadRequest(f"prompt + max_tokens is {n} tokens, longer than the model's context of {context} "
                         "(max_seq_len)", "max_tokens")
    return req


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- response shapes ---------------------------------------------------------------------------

class TextShape:
    """OpenAI's completion objects: each choice (and each streamed chunk's) carries `text`."""
    id_prefix, full_object, chunk_object = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(text: str, ids: list[int], finish: str | None, streaming: bool) -> dict:
        return dict(index=0, text=text, logprobs=None, finish_reason=finish, token_ids=ids)

    @staticmethod
    def opening() -> dict | None:
        return None


class ChatShape:
    """OpenAI's chat objects: the answer is a `message`; streamed chunks carry a `delta`, the
    first one the role."""
    id_prefix, full_object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(text: str, ids: list[int], finish: str | None, streaming: bool) -> dict:
        if streaming:
            delta = dict(content=text) if text or finish is None else {}
            return dict(index=0, delta=delta, logprobs=None, finish_reason=finish, token_ids=ids)
        return dict(index=0, message=dict(role="assistant", content=text), logprobs=None, finish_reason=finish,
                    token_ids=ids)

    @staticmethod
    def opening() -> dict | None:
        return dict(index=0, delta=dict(role="assistant", content=""), logprobs=None, finish_reason=None)
