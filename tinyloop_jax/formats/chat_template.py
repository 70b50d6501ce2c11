"""Chat templates: a model's Jinja template rendered as Hugging Face `transformers` renders it.

The template comes from the model (a GGUF's `tokenizer.chat_template`, a folder's
`chat_template.jinja` or `tokenizer_config.json`) and is untrusted code, so it runs in jinja2's
`ImmutableSandboxedEnvironment` with transformers' settings: `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, a `{% generation %}` block (rendered as its body), `raise_exception`,
`strftime_now` and a `tojson` filter that does not escape HTML (`json.dumps`, `ensure_ascii=False`).

    >>> render("{% for m in messages %}<{{ m.role }}>{{ m.content }}\\n{% endfor %}",
    ...        [{"role": "user", "content": "hi"}], add_generation_prompt=False)
    '<user>hi\\n'
"""

from __future__ import annotations

import datetime
import functools
import json

ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages) -> list[dict]:
    """A list of {"role", "content"} dicts, as plain dicts (keys with None values dropped).
    ValueError naming the message and field that is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(m.get('content')).__name__}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


@functools.lru_cache(maxsize=16)
def compile_template(template: str):
    """The jinja2 template object of `template` (cached: a model renders one template many times)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks the assistant's part for training masks): its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


def render(template: str, messages, add_generation_prompt: bool = True, **kwargs) -> str:
    """`messages` rendered by chat template `template` (transformers' `apply_chat_template(...,
    tokenize=False)`). `kwargs` (the special tokens `bos_token`, `eos_token`, ... and any extra
    variables) are visible to the template; `tools` and `documents` are None."""
    import jinja2

    messages = check_messages(messages)
    try:
        return compile_template(template).render(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from e
