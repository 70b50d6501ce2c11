"""Structured output and tool calls at the edge: a body's `response_format` or vLLM's
`structured_outputs` (`parse_format`), compiled against the served tokenizer (`with_grammar`);
OpenAI tool calls on the chat route: the `tools` a request offers and its `tool_choice`
(`parse`), the answer forced to be one call where the choice says so (`forced_format`: a JSON
schema, {"name": <a tool>, "arguments": <its parameters>}), the answer read back as `tool_calls`
(`calls_in`: that object, or `<tool_call>` blocks the model wrote on its own under "auto"), and
a conversation's tool turns written for templates that know no tools (`plain_messages`).

    tool_choice   "none": the tools are not shown, the answer is text
                  "auto" (the default with tools): shown; a call the model writes is returned
                  "required" / {"type": "function", "function": {"name": N}}: the answer is a
                  call (of N), by grammar
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets

from .handles import BadRequest

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools: name -> parameters schema, the choice ("auto", "required" or a
    function's name), and the request's `tools` list as given (a tool-aware template's)."""

    functions: dict
    choice: str
    given: tuple


def parse(body: dict) -> Tools | None:
    """`tools` and `tool_choice` of a chat body -> Tools (None: no tools, or tool_choice "none").
    BadRequest naming the field for a malformed tool, a repeated name, an unknown choice."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise BadRequest(f"{legacy} is the deprecated form: send tools and tool_choice", legacy)
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    functions = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = f.get("name") if isinstance(f, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise BadRequest(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}} with a name of "
                             "letters, digits, _ . - (at most 64)", f"tools[{i}]")
        if name in functions:
            raise BadRequest(f"tools[{i}]: the name {name!r} is given twice", f"tools[{i}]")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        functions[name] = params
    if choice in (None, "auto", "required"):
        choice = choice or "auto"
    elif choice == "none":
        return None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if choice not in functions:
            raise BadRequest(f"tool_choice names {choice!r}, which is not among the tools ({', '.join(functions)})",
                             "tool_choice")
    else:
        raise BadRequest(f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}}, got "
                         f"{json.dumps(choice)[:80]}", "tool_choice")
    return Tools(functions, choice, tuple(tools))


def _call_schema(name: str, params: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_format(tools: Tools | None) -> dict | None:
    """The response_format that forces the answer to be one call (required: of any tool; a
    named choice: of that one); None under "auto"."""
    if tools is None or tools.choice == "auto":
        return None
    names = list(tools.functions) if tools.choice == "required" else [tools.choice]
    schemas = [_call_schema(n, tools.functions[n]) for n in names]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def calls_in(text: str, tools: Tools) -> list[dict] | None:
    """The answer's tool calls in OpenAI's shape, or None when it holds none: the whole answer
    one {"name", "arguments"} object (a forced call), else its <tool_call> blocks; a call of a
    tool not offered, or whose arguments are not an object, is not a call."""
    blocks = CALL.findall(text) or [text]
    calls = []
    for b in blocks:
        try:
            value = json.loads(b)
        except ValueError:
            return None
        if not (isinstance(value, dict) and value.get("name") in tools.functions
                and isinstance(value.get("arguments", {}), dict)):
            return None
        calls.append(dict(id=f"call_{secrets.token_hex(12)}", type="function",
                          function=dict(name=value["name"], arguments=json.dumps(value.get("arguments", {})))))
    return calls


def check_calls(m: dict, i: int) -> list | None:
    """An assistant message's earlier `tool_calls` (OpenAI's shape, arguments a JSON object's
    text), checked."""
    calls = m.get("tool_calls")
    if calls in (None, []):
        return None
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str) for c in calls)
    try:
        ok = ok and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    except ValueError:
        ok = False
    if not ok:
        raise BadRequest(f"messages[{i}].tool_calls must be a list of {{id, type: function, function: {{name, "
                         "arguments: a JSON object as text}}}}", f"messages[{i}].tool_calls")
    return calls


def plain_messages(messages: list, tools: Tools | None, template: str) -> tuple[list, dict]:
    """A conversation's messages for the chat template, and the template's extra variables. A
    template that knows tools (it names `tools`) gets them and the tool turns as they are; any
    other gets the tools described in the system message, a past call as the assistant's
    <tool_call> text and a tool's result as a user turn in <tool_response>."""
    if "tools" in template:  # (as transformers passes them: a call's arguments as an object)
        out = [dict(m, content=m["content"] or "", **({"tool_calls": [
            dict(c, function=dict(c["function"], arguments=json.loads(c["function"]["arguments"])))
            for c in m["tool_calls"]]} if m.get("tool_calls") else {})) for m in messages]
        return out, ({} if tools is None else dict(tools=list(tools.given)))
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps(dict(name=c['function']['name'], arguments=json.loads(c['function']['arguments'])))}\n</tool_call>"  # noqa: E501
                              for c in m["tool_calls"])
            out.append(dict(role="assistant", content=((m.get("content") or "") + "\n" + calls).strip()))
        elif m["role"] == "tool":
            out.append(dict(role="user", content=f"<tool_response>\n{m['content']}\n</tool_response>"))
        else:
            out.append(dict(role=m["role"], content=m["content"]))
    if tools is not None:
        text = ("You can call these functions. To call one, answer with <tool_call>{\"name\": <function name>, "
                "\"arguments\": <arguments object>}</tool_call> and nothing else.\n<tools>\n"
                + "\n".join(json.dumps(t) for t in tools.given) + "\n</tools>")
        if out and out[0]["role"] == "system":
            out[0] = dict(role="system", content=out[0]["content"] + "\n\n" + text)
        else:
            out.insert(0, dict(role="system", content=text))
    return out, {}


# vLLM's `structured_outputs` extras -> the response_format each means
_STRUCTURED = dict(json=lambda v: dict(type="json_schema", json_schema=dict(name="structured_outputs", schema=v)),
                   regex=lambda v: dict(type="regex", regex=v), choice=lambda v: dict(type="choice", choice=v),
                   grammar=lambda v: dict(type="grammar", grammar=v))


def parse_format(body: dict) -> tuple | None:
    """OpenAI's `response_format` or vLLM's `structured_outputs` extra ({"json": schema} /
    {"regex": ...} / {"choice": [...]} / {"grammar": Lark or GBNF}), one of them -> (the
    response_format dict, the field's name), compiled against the model by `with_grammar`;
    None: free text."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf in (None, {"type": "text"}):
        rf = None
    if so is None:
        return None if rf is None else (rf, "response_format")
    if rf is not None:
        raise BadRequest("response_format and structured_outputs: give one or the other", "structured_outputs")
    if not (isinstance(so, dict) and len(so) == 1 and next(iter(so)) in _STRUCTURED):
        raise BadRequest(f"structured_outputs must be an object with one of {', '.join(_STRUCTURED)}, got "
                         f"{json.dumps(so)[:80]}", "structured_outputs")
    (key, value), = so.items()
    return _STRUCTURED[key](value), "structured_outputs"


def with_grammar(req, tokenizer, vocab_size: int):
    """The request's structured output compiled against the served tokenizer (`Grammar.of`,
    cached by the spec) into its sampling knobs; an unsupported keyword or a bad grammar is a
    BadRequest naming the field."""
    if req.format is None:
        return req
    from ..decoding.grammar import Grammar

    spec, param = req.format
    try:
        g = Grammar.of(spec, tokenizer, vocab_size)
    except ValueError as e:
        raise BadRequest(str(e), param) from None
    return req if g is None else dataclasses.replace(req, submit=dict(req.submit, response_format=g))
