"""A chat's `messages` into prompt ids: roles and content checked (content a string or OpenAI's
array of text parts), the model's chat template applied as transformers applies it. Bad input is
a `BadRequest` naming the message and field (the server's HTTP 400).
"""

from __future__ import annotations

import json

from . import tools as T
from .handles import BadRequest


CHAT_ROLES = ("system", "user", "assistant")


def text_of_parts(parts: list, i: int) -> str:
    """A message's content given as OpenAI's array of parts: its text parts joined by newlines
    (vLLM's and llama.cpp's rule for a template that takes a string); any other part type
    (image_url, input_audio, file, ...) is refused, naming it."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise BadRequest(f"{where} is a {kind!r} part; this server takes text parts only "
                             "({\"type\": \"text\", \"text\": ...})", where)
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string", f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(messages, tokenizer, add_generation_prompt: bool = True, tools: T.Tools | None = None) -> list[int]:
    """A chat's `messages` (system / user / assistant; content a string or text parts,
    `text_of_parts`; OpenAI's "developer" is "system"; an assistant's `tool_calls` and "tool"
    results, `tools.plain_messages`) -> the
    prompt ids: the model's chat template with the assistant's generation prompt, encoded as
    transformers does (the template writes the special tokens; none are added)."""
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
        if role not in CHAT_ROLES + ("tool",):
            raise BadRequest(f"messages[{i}].role is {m.get('role')!r}; expected one of "
                             f"{', '.join(CHAT_ROLES + ('tool',))}", f"messages[{i}].role")
        calls = T.check_calls(m, i) if role == "assistant" else None
        content = text_of_parts(m["content"], i) if isinstance(m.get("content"), list) else m.get("content")
        if not isinstance(content, str) and not (calls and content is None):
            got = "missing" if content is None else f"a {type(content).__name__}"
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, got {got}",
                             f"messages[{i}].content")
        out.append(dict(role=role, content=content, **({"tool_calls": calls} if calls else {})))
    out, extra = T.plain_messages(out, tools, tokenizer.chat_template)  # only role and content reach a plain template
    try:
        return tokenizer.apply_chat_template(out, add_generation_prompt=add_generation_prompt, tokenize=True,
                                             **extra).tolist()
    except ValueError as e:  # the template itself refused the conversation (raise_exception)
        raise BadRequest(str(e), "messages") from None
