"""Chat with a real model (SmolLM2-135M-Instruct, the session's `smollm2` fixture):
`POST /v1/chat/completions` driven by the official `openai` client, and `tinyloop chat` driven
through stdin.

- A greedy chat completion equals `model.generate` on the rendered prompt up to the end-of-turn
  token, which is not part of the content; streamed deltas concatenate to the same text.
- A second turn reads the whole first-turn prompt from the engine's prefix cache.
- Bad messages are HTTP 400 naming the field, and the server keeps serving; a model with no chat
  template is a 400 saying so.
- `tinyloop chat`: the answers equal greedy `generate` of the rendered conversation, the second
  turn prefills only its new tokens (the kept pages hold turn 1's prompt and answer; its
  end-of-turn token is fed with turn 2's chunk), /reset starts over, /exit quits.
"""

import io
import json
import sys
import urllib.request

import numpy as np
import pytest

import tinyloop_jax as tl

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
pytest.importorskip("uvicorn", reason="the serve extra installs uvicorn")

from conftest import tiny_config  # noqa: E402
from test_server import Server  # noqa: E402

MAX = 12  # tokens per answer: SmolLM2 answers these questions within it
FRANCE = "What is the capital of France?"
# a system message long enough (> 32 tokens) that the engine prefills the prompt into a pool slot
# and stores it, so a later turn can read it
SYSTEM = ("You are a helpful assistant. You answer questions about geography in one short sentence, "
          "you never use lists, and you do not greet the user or sign off.")


def user(text: str) -> dict:
    return dict(role="user", content=text)


def reference(model, tok, messages, max_tokens=MAX) -> tuple[list[int], list[int]]:
    """(the rendered prompt's ids, greedy `generate`'s answer ids up to an end-of-turn token)."""
    ids = tok.apply_chat_template(messages, tokenize=True).tolist()
    return ids, model.generate(ids, max_tokens=max_tokens, stop_sequences=[[i] for i in tok.eos_token_ids])[len(ids):]


def text_of(tok, answer: list[int]) -> str:
    return tok.decode([t for t in answer if t not in tok.eos_token_ids])


@pytest.fixture(scope="module")
def server(smollm2):
    model, tok = smollm2
    s = Server(model, eos=tok.eos_token_ids, tok=tok, name="smollm2", max_batch=4)
    yield s
    s.close()


def chat(server, messages, **kw):
    extra = {k: kw.pop(k) for k in ("top_k", "repetition_penalty", "loops", "ignore_eos") if k in kw}
    extra.update(kw.pop("extra_body", {}))
    if "max_completion_tokens" not in kw:
        kw.setdefault("max_tokens", MAX)
    return server.client.chat.completions.create(model="smollm2", messages=messages,
                                                 temperature=kw.pop("temperature", 0.0), extra_body=extra or None,
                                                 **kw)


@pytest.mark.slow
def test_chat_completion_equals_generate_up_to_end_of_turn(smollm2, server):
    model, tok = smollm2
    ids, want = reference(model, tok, [user(FRANCE)])
    assert want[-1] in tok.eos_token_ids  # the model ends its turn by itself
    r = chat(server, [user(FRANCE)])
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "smollm2"
    assert c.message.role == "assistant" and c.finish_reason == "stop"
    assert c.message.content == text_of(tok, want) and "Paris" in c.message.content
    assert c.token_ids == want  # the emitted ids, the end-of-turn token last
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(ids), len(want), len(ids) + len(want))
    # max_completion_tokens cuts the answer short: "length"
    r = chat(server, [user(FRANCE)], max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == tok.decode(want[:3])


@pytest.mark.slow
def test_streamed_deltas_concatenate_to_the_same_text(smollm2, server):
    model, tok = smollm2
    full = chat(server, [user(FRANCE)]).choices[0]
    parts = list(chat(server, [user(FRANCE)], stream=True, stream_options={"include_usage": True}))
    assert all(p.object == "chat.completion.chunk" for p in parts)
    assert parts[0].choices[0].delta.role == "assistant"
    chunks = [p.choices[0] for p in parts if p.choices]
    assert "".join(c.delta.content or "" for c in chunks) == full.message.content
    assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == len(full.token_ids)
    # on the wire: server-sent events ending with [DONE]
    body = json.dumps(dict(model="smollm2", messages=[user(FRANCE)], max_tokens=2, temperature=0, stream=True))
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        lines = [line for line in r.read().decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


@pytest.mark.slow
def test_second_turn_reads_the_first_from_the_prefix_cache(smollm2, server):
    model, tok = smollm2
    turn1 = [dict(role="system", content=SYSTEM), user("What is the capital of Italy?")]
    ids1, want1 = reference(model, tok, turn1)
    r1 = chat(server, turn1)
    assert r1.choices[0].token_ids == want1
    turn2 = turn1 + [dict(role="assistant", content=r1.choices[0].message.content), user("And of Spain?")]
    ids2, want2 = reference(model, tok, turn2)
    assert ids2[:len(ids1)] == ids1  # the second request starts with the first one's prompt
    r2 = chat(server, turn2)
    assert r2.choices[0].token_ids == want2 and "Madrid" in r2.choices[0].message.content
    cached1, cached2 = r1.usage.prompt_tokens_details.cached_tokens, r2.usage.prompt_tokens_details.cached_tokens
    assert cached2 >= len(ids1) > cached1  # all of turn 1's prompt was read, not prefilled again


@pytest.mark.slow
@pytest.mark.parametrize("messages, field", [
    (None, "messages"),
    ([], "messages"),
    ("What is the capital of France?", "messages"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, "hi"], "messages[1]"),
])
def test_bad_messages_are_400_naming_the_field(server, messages, field):
    body = dict(model="smollm2", max_tokens=2, temperature=0)
    if messages is not None:
        body["messages"] = messages
    status, err = server.post_raw(json.dumps(body).encode(), "/v1/chat/completions")
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == field and field in err["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        chat(server, [{"role": "robot", "content": "hi"}])
    assert chat(server, [user("Hi")], max_tokens=1).choices[0].finish_reason == "length"  # still serving


def test_model_without_chat_template_is_400():
    from tinyloop_jax.cli import BUNDLED

    s = Server(tl.Model.load(BUNDLED))  # the bundled byte model: no chat template
    try:
        status, err = s.post_raw(json.dumps(dict(model="tiny", messages=[user("hi")])).encode(),
                                 "/v1/chat/completions")
        assert status == 400 and "no chat template" in err["error"]["message"]
        assert s.client.completions.create(model="tiny", prompt="The", max_tokens=1).choices[0].text is not None
    finally:
        s.close()


def test_tinyloop_chat_needs_a_chat_template(capsys):
    from tinyloop_jax import cli

    assert cli.main(["chat"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and "--model smollm2" in err


@pytest.mark.slow
def test_tinyloop_chat_through_stdin(smollm2, monkeypatch, capsys):
    from tinyloop_jax import cli
    from tinyloop_jax.api import chat as chat_module

    model, tok = smollm2
    made = []

    class Recording(chat_module.Conversation):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(chat_module, "Conversation", Recording)
    # the session's model rather than a second load of the same file; the name still picks the tokenizer
    monkeypatch.setattr(cli, "_load", lambda path, kv_mode, *rest, **kw: model)
    italy = "And of Italy?"
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{FRANCE}\n{italy}\n/reset\n{FRANCE}\n/exit\n{italy}\n"))
    assert cli.main(["chat", "--model", "smollm2", "--max-tokens", str(MAX)]) == 0

    ids1, a1 = reference(model, tok, [user(FRANCE)])
    ids2, a2 = reference(model, tok, [user(FRANCE), dict(role="assistant", content=text_of(tok, a1)), user(italy)])
    assert capsys.readouterr().out == f"{text_of(tok, a1)}\n{text_of(tok, a2)}\n{text_of(tok, a1)}\n"
    conv, = made
    turns = conv.turns
    assert [list(t.answer) for t in turns] == [a1, a2, a1]  # /exit: the last line was never read
    assert (turns[0].reused_tokens, turns[0].prefill_tokens) == (0, len(ids1))
    # turn 2 continued from the kept pages: turn 1's prompt + answer were read, only the answer's
    # end-of-turn token (never fed) and the tokens the template added after it were prefilled
    assert ids2[:len(ids1) + len(a1)] == ids1 + a1
    kept = len(ids1) + len(a1) - 1
    assert (turns[1].reused_tokens, turns[1].prefill_tokens) == (kept, len(ids2) - kept)
    assert (turns[2].reused_tokens, turns[2].prefill_tokens) == (0, len(ids1))  # after /reset
    # the kept cache after the last turn is that of prompt + answer, as a from-scratch prefill's
    assert conv.prefix.prompt.tolist() == ids1 + a1
    np.testing.assert_allclose(np.asarray(conv.prefix.logits), np.asarray(model.build_prefix_cache(ids1 + a1).logits),
                               atol=1e-3, rtol=0)


@pytest.mark.slow
def test_engine_requests_in_flight_equal_generate(smollm2, server):
    """SmolLM2 in the engine on pages (the server's: its programs compiled once): four chats
    over one system prompt decoded in the same steps, a fifth joining mid-run; each equals
    greedy `generate` up to its end of turn, and the later ones read the system prompt's pages
    instead of prefilling it."""
    model, tok = smollm2
    questions = ["What is the capital of Italy?", "What is the capital of Spain?", "Name a river in France.",
                 "What is the capital of Japan?", "Name a mountain in Switzerland."]
    refs = [reference(model, tok, [dict(role="system", content=SYSTEM), user(q)]) for q in questions]
    stops = [[e] for e in tok.eos_token_ids]
    eng = server.engine
    before = eng.stats()
    first = eng.submit(refs[0][0], max_tokens=MAX, stop_sequences=stops)
    next(iter(first.stream()))  # its prompt is in the pages
    handles = [first] + [eng.submit(ids, max_tokens=MAX, stop_sequences=stops) for ids, _ in refs[1:4]]
    next(iter(handles[-1].stream()))
    handles.append(eng.submit(refs[4][0], max_tokens=MAX, stop_sequences=stops))  # joins mid-run
    for (ids, want), h in zip(refs, handles):
        assert h.result()[len(ids):] == want
    s = eng.stats()
    system_tokens = len(tok.apply_chat_template([dict(role="system", content=SYSTEM)], tokenize=True))
    assert all(h.prefix_tokens >= system_tokens - 16 for h in handles[1:])  # the shared pages, at least
    rows, steps = (s.get(k, 0) - before.get(k, 0) for k in ("batch_rows", "decode_steps"))
    assert rows / steps > 1.5, (rows, steps)  # decoded together


@pytest.mark.slow
def test_conversation_takes_the_request_as_values(smollm2):
    """`Conversation(params=SamplingParams, plan=DepthPlan)` answers as its keywords do (a
    sampled turn, the same seed)."""
    model, tok = smollm2
    by_values = tl.Conversation(model, tok, params=tl.SamplingParams(max_tokens=MAX, temperature=0.9, seed=4),
                                plan=tl.Fixed(loops=1))
    by_keywords = tl.Conversation(model, tok, max_tokens=MAX, temperature=0.9, seed=4, loops=1)
    assert "".join(by_values.send(FRANCE)) == "".join(by_keywords.send(FRANCE))
    assert by_values.turns[0].answer == by_keywords.turns[0].answer


def test_conversation_refuses_what_it_cannot_run():
    class Tok:
        chat_template, eos_token_ids = "{{ messages }}", [0]

    model = tl.Model.random(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="fixed depth .* Adaptive"):
        tl.Conversation(model, Tok(), plan=tl.Adaptive(criterion="kl", threshold=0.1))
    with pytest.raises(ValueError, match="take no stop_sequences"):
        tl.Conversation(model, Tok(), params=tl.SamplingParams(stop_sequences=((1,),)))
    with pytest.raises(ValueError, match="pass temperature inside the SamplingParams"):
        tl.Conversation(model, Tok(), temperature=0.5, params=tl.SamplingParams())


@pytest.mark.slow
def test_demo_on_smollm2_shares_the_document_and_answers_alike(smollm2):
    """`tinyloop demo` on SmolLM2: a document of a few hundred tokens shared by the questions;
    SHARED's and SERVED's greedy answers equal NO_CACHE's token for token, in real sentences."""
    from tinyloop_jax import demo

    model, tok = smollm2
    res = demo.run(model, tok, 2, warm=False, max_tokens=16)  # (the timings are not checked)
    assert res.document_tokens > 300
    assert res.same("SHARED") and res.same("SERVED")
    assert all(len(a) > 3 for a in res.answers["NO_CACHE"])
    out = demo.report(res, tok, 1)
    assert "SHARED yes, SERVED yes" in out and "Eiffel" in out


def test_chat_answers_in_json_schema_and_refuses_a_bad_schema(smollm2, server):
    """response_format json_schema (strict) over HTTP with the openai client: the answer parses,
    with the schema's keys, and equals generate under the same grammar; an unsupported keyword
    is a 400 naming response_format."""
    import json

    model, tok = smollm2
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}},
              "required": ["capital"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    r = chat(server, [user(FRANCE)], response_format=rf)
    c = r.choices[0]
    assert c.finish_reason == "stop" and set(json.loads(c.message.content)) == {"capital"}
    ids = tok.apply_chat_template([user(FRANCE)], tokenize=True)
    want = model.generate(ids, max_tokens=MAX, stop_sequences=[[e] for e in tok.eos_token_ids],
                          response_format=tl.Grammar.of(rf, tok, model.config()["vocab_size"]))[len(ids):]
    assert c.token_ids == want
    bad = dict(rf, json_schema=dict(rf["json_schema"], schema={"type": "array", "uniqueItems": True}))
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, [user(FRANCE)], response_format=bad)
    assert "uniqueItems" in str(e.value) and e.value.body["param"] == "response_format"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}},
                                       "required": ["zone"], "additionalProperties": False}}}


def test_tool_calls_required_named_streamed_and_a_result_round_trip(server):
    """tool_choice named and required: the answer is a call with arguments valid for its tool
    (jsonschema), finish_reason tool_calls, streamed too (one delta with the call); the call and
    its result sent back give a text answer; an unknown tool name is a 400 and the server serves on."""
    import json

    import jsonschema

    ask = [user("What is the weather in Paris?")]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, kw in ((named, {}), ("required", dict(temperature=0.8, seed=2))):
        r = chat(server, ask, tools=[WEATHER, TIME], tool_choice=choice, max_tokens=64, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        assert call.id.startswith("call_") and (choice != named or call.function.name == "get_weather")
    parts = list(chat(server, ask, tools=[WEATHER], tool_choice=named, stream=True, max_tokens=64))
    last = [p.choices[0] for p in parts if p.choices][-1]
    assert last.finish_reason == "tool_calls" and last.delta.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(last.delta.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
    turn = ask + [dict(role="assistant", content=None, tool_calls=[call.model_dump(exclude_none=True)]),
                  dict(role="tool", tool_call_id=call.id, content='{"temperature": 21, "sky": "clear"}')]
    r = chat(server, turn, tools=[WEATHER], max_tokens=24)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, ask, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in str(e.value)
    assert chat(server, [user(FRANCE)], max_tokens=4).choices[0].finish_reason == "length"


def test_calls_are_read_from_tool_call_blocks_and_nothing_else():
    """Under tool_choice auto the answer is a call only where the model wrote one for an offered tool."""
    from tinyloop_jax.serving import tools as T

    tools = T.parse({"tools": [WEATHER]})
    calls = T.calls_in('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
                       '\n</tool_call>', tools)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert T.calls_in("It is sunny in Oslo.", tools) is None
    assert T.calls_in('<tool_call>{"name": "other", "arguments": {}}</tool_call>', tools) is None
    assert T.parse({"tools": [WEATHER], "tool_choice": "none"}) is None


SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                "color": {"enum": ["red", "green", "blue"]}},
               "required": ["name", "color"], "additionalProperties": False},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                               "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                              "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
             "required": ["a", "b"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"nick": {"anyOf": [{"type": "string", "maxLength": 12},
                                                                     {"type": "null"}]}},
                 "required": ["nick"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_answer_validates_against_its_schema(server, name):
    """Through the openai client on SmolLM2: greedy, sampled with n = 2, and streamed answers
    each parse and validate (jsonschema) against the request's schema."""
    import jsonschema

    schema = SCHEMAS[name]
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    ask = [user(f"Answer as JSON: an example {name}.")]
    texts = [c.message.content for c in chat(server, ask, response_format=rf, max_tokens=80).choices]
    texts += [c.message.content for c in chat(server, ask, response_format=rf, max_tokens=80, temperature=0.8,
                                              n=2, seed=7).choices]
    parts = chat(server, ask, response_format=rf, max_tokens=80, stream=True)
    texts.append("".join(p.choices[0].delta.content or "" for p in parts if p.choices))
    assert len(texts) == 4
    for t in texts:
        jsonschema.validate(json.loads(t), schema)


def test_a_gbnf_grammar_and_a_regex_through_the_openai_client(server):
    """vLLM's structured_outputs extras on SmolLM2: a GBNF grammar (n = 2, sampled) and a regex
    (streamed): every answer is in the grammar's language."""
    import re

    gbnf = 'root ::= ("yes" | "no") ", because " [a-z ]{1,24}'
    r = chat(server, [user("Is Paris in France? Answer yes or no and why.")], max_tokens=40, temperature=0.8, n=2,
             seed=3, extra_body={"structured_outputs": {"grammar": gbnf}})
    for c in r.choices:
        assert re.fullmatch(r"(yes|no), because [a-z ]{1,24}", c.message.content), c.message.content
    parts = chat(server, [user("Give a date.")], max_tokens=16, stream=True,
                 extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text), text
