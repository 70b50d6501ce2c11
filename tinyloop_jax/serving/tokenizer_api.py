"""vLLM's tokenizer routes of `tinyloop serve`, as pure functions from a JSON body to the
response object (the app wraps them; a bad body raises `protocol.BadRequest` naming the field,
the server's HTTP 400):

    POST /tokenize        {"prompt": str, "add_special_tokens": true}              (text form)
                          {"messages": [...], "add_generation_prompt": true}       (chat form)
                       -> {"tokens": [ids], "count": n, "max_model_len": context, "token_strs": null}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  -> tokenizer_class, vocab_size, chat_template, bos/eos/pad/unk tokens (text
                             and id), model_max_length, max_model_len

The text form's ids are `tokenizer.encode(prompt, special=add_special_tokens)`, the chat form's
those `/v1/chat/completions` would prefill (the template writes the special tokens). Token ids are
the model's: [0, vocab_size), the range a prompt or a completion's `token_ids` take.
"""

from __future__ import annotations

import json

from .messages import parse_messages
from .protocol import BadRequest, _bool, _object


def _model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model is not None and model != model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {model_name!r}", "model")


def _unsupported(body: dict, *names: str) -> None:
    for name in names:
        if body.get(name):
            raise BadRequest(f"{name} is not supported", name)


def tokenize(body, tokenizer, model_name: str, context: int) -> dict:
    """POST /tokenize: a prompt's ids (text form), or a chat's through the model's template.

    >>> tokenize({"prompt": "hi"}, ByteTokenizer(), "m", 128)        # doctest: +SKIP
    {'count': 2, 'max_model_len': 128, 'tokens': [104, 105], 'token_strs': None}
    """
    body = _object(body)
    _model(body, model_name)
    _unsupported(body, "return_token_strs", "continue_final_message")
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise BadRequest("give prompt (text) or messages (a chat), not both", "messages")
        if _bool(body, "add_special_tokens", False):  # vLLM's chat default: the template writes them
            raise BadRequest("add_special_tokens is not supported with messages: the chat template writes the "
                             "special tokens", "add_special_tokens")
        ids = parse_messages(body["messages"], tokenizer, _bool(body, "add_generation_prompt", True))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            got = "nothing" if prompt is None else json.dumps(prompt)[:80]
            raise BadRequest(f"prompt (a string) or messages (a chat) is required, got {got}", "prompt")
        ids = tokenizer.encode(prompt, special=_bool(body, "add_special_tokens", True)).tolist()
    return dict(count=len(ids), max_model_len=context, tokens=ids, token_strs=None)


def detokenize(body, tokenizer, model_name: str, vocab_size: int) -> dict:
    """POST /detokenize: token ids in [0, vocab_size) -> their text (special tokens dropped, as
    completions' text drops them)."""
    body = _object(body)
    _model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        got = "nothing" if tokens is None else json.dumps(tokens)[:80]
        raise BadRequest(f"tokens must be a list of token ids (integers), got {got}", "tokens")
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"tokens[{bad}] = {tokens[bad]} is not a token id in [0, {vocab_size})", "tokens")
    return dict(prompt=tokenizer.decode(tokens))


def tokenizer_info(tokenizer, context: int) -> dict:
    """GET /tokenizer_info: the tokenizer's own `info()`, with model_max_length the served context
    unless the tokenizer states one, and max_model_len the served context."""
    info = dict(tokenizer.info()) if hasattr(tokenizer, "info") else dict(tokenizer_class=type(tokenizer).__name__)
    info.setdefault("model_max_length", context)
    info["max_model_len"] = context
    return info
