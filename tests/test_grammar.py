"""Structured output (`response_format`, `decoding/grammar.py`): the grammar's mask on the one
step, against an independent reference — a from-scratch forward per token, llguidance's own
numpy mask, the logit bias and repetition penalty in numpy, argmax — and the outputs parse."""


import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

import tinyloop_jax as tl
from conftest import tiny_config

V = 300  # the byte tokenizer's 260 ids and 40 more the model has (never text)
TOK = tl.ByteTokenizer()
PROMPT = [int(b) for b in b"The answer: "]
FORMATS = {"json_object": {"type": "json_object"},
           "regex": {"type": "regex", "regex": "[0-9]{2,3}(-[a-f]{2})?"},
           "choice": {"type": "choice", "choice": ["north", "south", "east", "west"]},
           "gbnf": {"type": "grammar", "grammar": 'root ::= "(" [xyz]+ ")"'}}


@pytest.fixture(scope="module")
def model():
    return tl.Model.random(tiny_config(vocab_size=V), seed=0)


def grammar(rf) -> tl.Grammar:
    return tl.Grammar.of(rf, TOK, V)


def reference(model, prompt, g, n, bias=None, penalty=1.0) -> list[int]:
    """Greedy tokens under grammar g by a from-scratch forward per token: the logit bias, the
    repetition penalty over prompt + output, then llguidance's mask, argmax; until the grammar
    ends or n tokens."""
    m, out = g.matcher(), []
    for _ in range(n):
        logits = np.array(model.next_token_logits(prompt + out), np.float32)
        for t, b in (bias or {}).items():
            logits[t] += b
        seen = np.zeros(V, bool)
        seen[prompt + out] = True
        logits = np.where(seen, np.where(logits > 0, logits / penalty, logits * penalty), logits)[None]
        mask = allocate_token_bitmask(1, V)
        fill_next_token_bitmask(m, mask)
        apply_token_bitmask_inplace(logits, mask)
        out.append(int(np.argmax(logits[0])))
        assert m.consume_token(out[-1])
        if m.is_stopped():
            break
    return out


@pytest.mark.parametrize("kind", list(FORMATS))
def test_constrained_greedy_equals_a_from_scratch_reference(model, kind):
    g = grammar(FORMATS[kind])
    bias = {ord("5"): 3.0, ord("{"): -2.0, ord("x"): 1.5}
    got = model.generate(PROMPT, max_tokens=12, response_format=g, logit_bias=bias, repetition_penalty=1.3)
    want = reference(model, PROMPT, g, 12, bias, 1.3)
    assert got[len(PROMPT):] == want
    m = g.matcher()
    assert all(m.consume_token(t) for t in want)  # what it emitted the grammar takes, in order


@pytest.mark.parametrize("kind", list(FORMATS))
def test_speculative_rounds_follow_the_grammar(model, kind):
    """Drafts drawn under the mask, verified under the same masks, the matchers rolled back past
    the kept drafts: greedy rounds emit plain masked greedy decoding's tokens (the from-scratch
    reference), ending where the grammar ends even inside a round; sampled rounds follow the
    grammar."""
    g = grammar(FORMATS[kind])
    want = model.generate(PROMPT, max_tokens=12, response_format=g)
    assert want[len(PROMPT):] == reference(model, PROMPT, g, 12)
    for k in (1, 3):
        assert model.generate(PROMPT, max_tokens=12, response_format=g, draft_loops=1, lookahead=k) == want
    out = model.generate(PROMPT, max_tokens=16, response_format=g, draft_loops=1, lookahead=3, temperature=0.8,
                         seed=1)[len(PROMPT):]
    m = g.matcher()
    assert all(m.consume_token(t) for t in out) and (len(out) == 16 or m.is_stopped())


def test_the_engines_speculative_rounds_follow_the_grammar(model):
    """The engine's rounds (its matchers take what it reads; the drafts rolled back after each
    round) beside a free speculative row: each equals generate, greedy and sampled."""
    g = grammar(FORMATS["regex"])  # (it ends inside a round: the cut)
    work = [(PROMPT, dict(max_tokens=12, response_format=g, draft_loops=1, lookahead=3)),
            (PROMPT[2:], dict(max_tokens=12, draft_loops=1, lookahead=3)),
            (PROMPT, dict(max_tokens=16, response_format=g, draft_loops=1, lookahead=3, temperature=0.8, seed=0))]
    with tl.Engine(model, max_batch=2) as eng:
        hs = [eng.submit(p, **kw) for p, kw in work]
        assert [h.result() for h in hs] == [model.generate(p, **kw) for p, kw in work]


def test_choices_and_regexes_end_where_their_grammar_ends(model):
    """A bounded grammar ends the output before max_tokens — where nothing may follow, or at
    its end-of-sequence token where the model chose to stop — and the text is one of the
    choices / matches the regex; sampled rows too."""
    import re

    for seed in range(3):
        for kind, ok in (("choice", lambda t: t in FORMATS["choice"]["choice"]),
                         ("regex", lambda t: re.fullmatch(FORMATS["regex"]["regex"], t))):
            out = model.generate(PROMPT, max_tokens=20, response_format=grammar(FORMATS[kind]), temperature=0.8,
                                 seed=seed)[len(PROMPT):]
            assert len(out) < 20 and TOK.EOS not in out[:-1] and ok(TOK.decode(out)), out


def test_no_bias_revives_a_forbidden_token_and_padded_ids_never_come(model):
    """+100 on a letter, on the byte tokenizer's spare special and on ids past the tokenizer
    (the model's padding): a digits-only grammar still gets digits, greedy and sampled."""
    g = grammar({"type": "regex", "regex": "[0-9]{6}"})
    bias = {ord("x"): 100.0, 259: 100.0, 280: 100.0, 299: 100.0}
    for temperature in (0.0, 1.0):
        out = model.generate(PROMPT, max_tokens=8, response_format=g, logit_bias=bias, temperature=temperature)
        digits = [t for t in out[len(PROMPT):] if ord("0") <= t <= ord("9")]
        assert out[len(PROMPT):] == digits and len(digits) == 6
    free = model.generate(PROMPT, max_tokens=3, logit_bias=bias)[len(PROMPT):]
    assert set(free) <= {ord("x"), 259, 280, 299}  # (the bias alone does win)


@pytest.mark.parametrize("loop", ["device", "host"])
def test_a_batch_mixes_free_and_constrained_rows(model, loop, monkeypatch):
    """generate_batch with one SamplingParams per row: the constrained row equals its own
    generate, the free row the unconstrained generate (the same step body beside it); with the
    loop on the device (masks by callback) and driven from the host (a dispatch a token)."""
    from tinyloop_jax.decoding import paged_decode

    monkeypatch.setattr(paged_decode, "GRAMMAR_LOOP", loop)
    g = grammar(FORMATS["gbnf"])
    other = [int(b) for b in b"Free text: "]
    rows = [tl.SamplingParams(max_tokens=10, response_format=g), tl.SamplingParams(max_tokens=10),
            tl.SamplingParams(max_tokens=10, temperature=0.9, seed=5, response_format=g),
            tl.SamplingParams(max_tokens=10, response_format=grammar(FORMATS["choice"])),  # ends first
            tl.SamplingParams(max_tokens=3)]  # and one that ends at its max_tokens
    prompts = [PROMPT, other, other, PROMPT, other]
    got = model.generate_batch(prompts, params=rows)
    assert got[0] == model.generate(PROMPT, max_tokens=10, response_format=g)
    assert got[0][len(PROMPT):] == reference(model, PROMPT, g, 10)
    assert got[1] == model.generate(other, max_tokens=10)
    assert got[2] == model.generate(other, params=rows[2])
    assert TOK.decode(got[2][len(other):])[0] == "("
    assert got[3][len(PROMPT):] == reference(model, PROMPT, grammar(FORMATS["choice"]), 10)
    assert len(got[3]) < len(PROMPT) + 10 and got[4] == model.generate(other, max_tokens=3)


def test_from_a_prefix_cache_equals_the_whole_prompt(model):
    g = grammar(FORMATS["json_object"])
    prefix = model.build_prefix_cache(PROMPT[:5])
    assert (model.generate_from_prefix_cache(prefix, suffix=PROMPT[5:], max_tokens=10, response_format=g)
            == model.generate(PROMPT, max_tokens=10, response_format=g))
    batch = model.generate_batch_from_prefix_cache(prefix, [PROMPT[5:], []], max_tokens=6, response_format=g)
    assert batch[0] == model.generate(PROMPT, max_tokens=6, response_format=g)
    assert batch[1] == model.generate(PROMPT[:5], max_tokens=6, response_format=g)


@pytest.mark.parametrize("rf, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": "not an object"}, "json_schema"),
    ({"type": "regex", "regex": "[0-9"}, "unclosed character class"),
    ({"type": "regex"}, "regex"),
    ({"type": "choice", "choice": []}, "choice"),
    ({"type": "grammar", "grammar": "start: foo"}, "foo"),
    ({"type": "yaml"}, "yaml"),
    ("json", "response_format must be an object"),
])
def test_bad_response_formats_are_value_errors_naming_them(rf, words):
    with pytest.raises(ValueError, match=words):
        grammar(rf)


def test_a_response_format_the_call_cannot_take_is_refused(model):
    with pytest.raises(ValueError, match="Grammar.of"):
        model.generate(PROMPT, response_format={"type": "json_object"})  # a dict needs the tokenizer
    with pytest.raises(ValueError, match="built for 300 token ids"):
        tl.Model.random(tiny_config(vocab_size=320), seed=0).generate(PROMPT, response_format=grammar(
            FORMATS["regex"]))
    assert tl.Grammar.of({"type": "text"}, TOK, V) is None


def test_the_engine_equals_generate_with_grammars_beside_free_rows(model):
    """Constrained and free requests in flight together in the engine (prompt chunks beside
    decode rows, greedy and sampled): each equals its own `generate`, and the grammar's rows
    finish as their grammar ends."""
    work = [(PROMPT, dict(max_tokens=12, response_format=grammar(FORMATS["json_object"]))),
            (PROMPT[:6], dict(max_tokens=10)),
            (PROMPT, dict(max_tokens=9, temperature=0.9, seed=3, response_format=grammar(FORMATS["choice"]))),
            ([int(b) for b in b"abc"], dict(max_tokens=12, temperature=0.7, seed=1)),
            (PROMPT[2:], dict(max_tokens=8, response_format=grammar(FORMATS["gbnf"])))]
    with tl.Engine(model, max_batch=4, prefill_chunk=8) as eng:
        handles = [eng.submit(p, **kw) for p, kw in work]
        got = [h.result() for h in handles]
        # then free requests, in another order, in the rows the grammar rows left: their solo answers
        again = [eng.submit(p, max_tokens=6).result() for p, _ in reversed(work)]
    assert got == [model.generate(p, **kw) for p, kw in work]
    assert again == [model.generate(p, max_tokens=6) for p, _ in reversed(work)]
    assert handles[2].finish_reason == "stop" and TOK.decode(got[2][len(PROMPT):]) in FORMATS["choice"]["choice"]


def test_completions_take_response_format_and_structured_outputs(model):
    """Over HTTP (the openai client): response_format and vLLM's structured_outputs extras give
    generate's tokens under the same grammar; a bad one is a 400 naming its field."""
    from test_server import Server

    import openai

    s = Server(model, eos=(TOK.EOS,), max_batch=2)
    try:
        text = "".join(chr(t) for t in PROMPT)
        for body, rf in ((dict(response_format=FORMATS["json_object"]), FORMATS["json_object"]),
                         (dict(structured_outputs={"regex": FORMATS["regex"]["regex"]}), FORMATS["regex"]),
                         (dict(structured_outputs={"choice": FORMATS["choice"]["choice"]}), FORMATS["choice"])):
            r = s.client.completions.create(model="tiny", prompt=text, max_tokens=10, temperature=0, extra_body=body)
            want = model.generate(PROMPT, max_tokens=10, stop_sequences=[[TOK.EOS]], response_format=grammar(rf))
            assert r.choices[0].token_ids == want[len(PROMPT):]
        for body, param in ((dict(response_format={"type": "regex", "regex": "[0-9"}), "response_format"),
                            (dict(structured_outputs={"yaml": "x"}), "structured_outputs"),
                            (dict(structured_outputs={"choice": []}), "structured_outputs")):
            with pytest.raises(openai.BadRequestError) as e:
                s.client.completions.create(model="tiny", prompt=text, max_tokens=4, extra_body=body)
            assert e.value.body["param"] == param, e.value.body
    finally:
        s.close()


def test_adaptive_depth_with_a_grammar_in_generate_and_the_engine():
    """Exits (a prompt exiting as a whole too) with a grammar: the engine equals generate, the
    text follows the grammar."""
    from conftest import huginn_model

    m = huginn_model(vocab_size=V)
    g = grammar(FORMATS["regex"])
    work = [(PROMPT, dict(max_tokens=8, loops=6, exit_criterion="entropy-diff", exit_threshold=1e-2,
                          response_format=g)),
            (PROMPT[3:], dict(max_tokens=8, loops=6, exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True,
                              response_format=g, temperature=0.8, seed=2))]
    want = [m.generate(p, **kw) for p, kw in work]
    with tl.Engine(m, max_batch=2, prefill_chunk=8) as eng:
        assert [eng.submit(p, **kw).result() for p, kw in work] == want
    import re
    assert all(re.fullmatch(FORMATS["regex"]["regex"], TOK.decode(w[len(p):])) for w, (p, _) in zip(want, work))


def test_warmup_compiles_the_masked_programs(model):
    """`warmup(grammar=True)` (with a speculative pair): a structured-output request, a
    speculative one and a free one after them trace none of the engine's programs (JAX's trace
    events), and answer as generate does."""
    import jax

    from tinyloop_jax.decoding import compiled

    names, traced = {fn.__name__ for fn, _ in compiled.JIT_OPTIONS.values()}, []

    def listen(event: str, secs: float, fun_name: str = "", **_) -> None:
        if event.endswith("jaxpr_trace_duration") and fun_name in names:
            traced.append(fun_name)

    g = grammar(FORMATS["regex"])
    with tl.Engine(model, max_batch=1, prefill_chunk=16) as eng:
        assert eng.warmup(grammar=True, speculation=((1, 2),)) > 0
        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            got = [eng.submit(PROMPT, max_tokens=8, response_format=g).result(),
                   eng.submit(PROMPT, max_tokens=8, response_format=g, draft_loops=1, lookahead=2).result(),
                   eng.submit(PROMPT, max_tokens=4).result()]
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
        assert traced == [] and eng.stats()["compiles_after_warmup"] == 0, (traced, eng.programs)
    want = model.generate(PROMPT, max_tokens=8, response_format=g)
    assert got == [want, want, model.generate(PROMPT, max_tokens=4)]


def test_a_prefix_store_and_a_conversation_take_a_grammar(model):
    """`PrefixStore.generate(params=...)` with a grammar answers as generate does; a
    `Conversation` with a response_format (OpenAI's dict) answers each turn as the from-scratch
    reference does on the turn's rendered prompt, its cache kept between turns."""
    g = grammar(FORMATS["choice"])
    store = tl.PrefixStore(model)
    p = tl.SamplingParams(max_tokens=8, response_format=g)
    assert store.generate(PROMPT, params=p) == model.generate(PROMPT, params=p)

    class Chat(tl.ByteTokenizer):  # "role: content" bytes, each message ended by the end-of-sequence id
        chat_template, eos_token_ids = "bytes", [TOK.EOS]

        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
            ids = [i for m in messages for i in [*f"{m['role']}: {m['content']}".encode(), TOK.EOS]]
            return np.array(ids + [*b"assistant: "] * add_generation_prompt, np.int32)

    conv = tl.Conversation(model, Chat(), max_tokens=12, response_format=FORMATS["choice"])
    for text in ("Which way?", "And then?"):
        ids = Chat().apply_chat_template(conv.messages + [dict(role="user", content=text)],
                                         add_generation_prompt=True, tokenize=True)
        answer = "".join(conv.send(text))
        assert list(conv.turns[-1].answer) == reference(model, list(ids), g, 12)
        assert answer in FORMATS["choice"]["choice"] and conv.turns[-1].finish_reason == "stop"
    assert conv.turns[-1].reused_tokens > 0
    sampled = tl.Conversation(model, Chat(), max_tokens=12, temperature=0.9, seed=4, response_format=g)
    assert "".join(sampled.send("Which way?")) in FORMATS["choice"]["choice"]
    with pytest.raises(ValueError, match="yaml"):
        tl.Conversation(model, Chat(), response_format={"type": "yaml"})
