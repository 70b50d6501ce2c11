"""`tinyloop serve` for real clients (issue 22, the HTTP edge), on one in-process server per
module over a tiny byte-vocabulary model, driven by the official `openai` client and raw HTTP:

- /tokenize, /detokenize, /tokenizer_info in vLLM's shapes: a round trip gives the text back and
  the ids of `tokenizer.encode` (or of the chat template); bad bodies are 400 naming the field.
- `api_key`: 401 (authentication_error) on /v1/* and the tokenizer routes without the key, 200
  with it; /health and /metrics stay open. CORS preflights answered for the listed origins only.
- `max_body`: a body over the limit is 413, by its Content-Length or, chunked, as soon as the
  limit is passed (the server does not wait for the rest); the next request is served.
- presence_penalty, frequency_penalty and logit_bias over HTTP equal `model.generate` with the
  same arguments, and move the greedy output the way OpenAI's semantics say.
- every bad value is a 400 naming the parameter, never a 500; a request that can never fit the
  memory budget is a 400 too.
- /metrics: per-depth prefix-cache queries / hits and loop passes as counters labelled `loops`.
"""

import json
import socket
import time
import urllib.request
from collections import Counter

import pytest
from conftest import tiny_config

import tinyloop_jax as tl

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra installs uvicorn")

import test_server  # noqa: E402
from test_server import complete  # noqa: E402

KEY = "sk-edge-test-key"
ORIGIN = "http://app.example"
LIMIT = 4096  # the module server's max_body (bytes)
EOS = tl.ByteTokenizer.EOS
CONTEXT = 128  # tiny_config's max_seq_len


class ChatBytes(tl.ByteTokenizer):
    """The byte tokenizer with a chat template, so the tiny model also serves chat requests."""

    chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        from tinyloop_jax.formats import chat_template

        text = chat_template.render(self.chat_template, messages, add_generation_prompt, **kw)
        return self.encode(text) if tokenize else text


TOK = ChatBytes()


class Server(test_server.Server):
    """test_server's in-process server on the byte tokenizer, its client holding the API key."""

    def __init__(self, model, app_kw=None, **engine_kw):
        super().__init__(model, eos=(EOS,), tok=TOK, name="tiny", app_kw=app_kw, api_key=KEY, **engine_kw)

    def call(self, path: str, body=None, key: str | None = KEY, method=None, headers=None):
        """(status, headers, JSON or text). `body`: a dict (sent as JSON, NaN and Infinity as
        Python's json writes them), bytes, or None."""
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        h = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
             **(headers or {})}
        req = urllib.request.Request(self.url + path, data=data, headers=h, method=method)
        try:
            with urllib.request.urlopen(req) as r:
                status, hdrs, raw = r.status, r.headers, r.read()
        except urllib.error.HTTPError as e:
            status, hdrs, raw = e.code, e.headers, e.read()
        try:
            return status, hdrs, json.loads(raw)
        except ValueError:
            return status, hdrs, raw.decode()


@pytest.fixture(scope="module")
def model():
    return tl.Model.random(tiny_config(vocab_size=260), seed=3)  # byte vocabulary


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, dict(api_key=KEY, cors_origins=(ORIGIN,), max_body=LIMIT), max_batch=2)
    yield s
    s.close()


def still_serving(server):
    assert complete(server, "ok", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


# ---- the tokenizer routes -----------------------------------------------------------------------

TEXTS = ["The \"for\" statement\n", "héllo wörld ✓ 🙂", "x"]


def test_tokenize_detokenize_round_trip(server):
    for text in TEXTS:
        status, _, r = server.call("/tokenize", dict(model="tiny", prompt=text))
        want = TOK.encode(text).tolist()
        assert status == 200 and r["tokens"] == want and r["count"] == len(want) and r["max_model_len"] == CONTEXT
        status, _, back = server.call("/detokenize", dict(model="tiny", tokens=r["tokens"]))
        assert status == 200 and back == {"prompt": text}
    status, _, r = server.call("/tokenize", dict(prompt="abc", add_special_tokens=False))
    assert status == 200 and r["tokens"] == [97, 98, 99]
    # the ids a completion returns read back as its text
    c = complete(server, "def f(x):", max_tokens=6, ignore_eos=True).choices[0]
    assert server.call("/detokenize", dict(tokens=c.token_ids))[2]["prompt"] == TOK.decode(c.token_ids)


def test_tokenize_chat_form_is_the_chat_template(server):
    messages = [dict(role="system", content="Be brief."), dict(role="user", content="Hi")]
    status, _, r = server.call("/tokenize", dict(messages=messages))
    want = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True).tolist()
    assert status == 200 and r["tokens"] == want and r["count"] == len(want)
    status, _, r = server.call("/tokenize", dict(messages=messages, add_generation_prompt=False))
    assert r["tokens"] == TOK.apply_chat_template(messages, add_generation_prompt=False, tokenize=True).tolist()
    # the same prompt a chat completion counts
    chat = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == len(want)


def test_tokenizer_info(server):
    status, _, info = server.call("/tokenizer_info", method="GET")
    assert status == 200
    assert info["tokenizer_class"] == "ChatBytes" and info["chat_template"] == TOK.chat_template
    assert info["model_max_length"] == CONTEXT and info["vocab_size"] == 260
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (256, 257, 258)


def test_tokenizer_routes_of_a_hugging_face_tokenizer(tmp_path):
    """A Hugging Face folder's tokenizer_config.json: class, special tokens (text and id), chat
    template and model_max_length as it states them; add_special_tokens adds its BOS or not."""
    from test_tokenizer import train_tokenizer

    from tinyloop_jax.serving.tokenizer_api import detokenize, tokenize, tokenizer_info

    train_tokenizer(90).save(str(tmp_path / "tokenizer.json"))
    config = dict(tokenizer_class="LlamaTokenizerFast", bos_token="<s>", eos_token="<s>", unk_token="[UNK]",
                  pad_token={"content": "[UNK]"}, model_max_length=2048, chat_template="{{ messages[0].content }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = tl.HFTokenizer(str(tmp_path))
    info = tokenizer_info(tok, CONTEXT)
    assert info["tokenizer_class"] == "LlamaTokenizerFast" and info["model_max_length"] == 2048
    assert (info["bos_token"], info["eos_token"], info["pad_token"], info["unk_token"]) == ("<s>", "<s>", "[UNK]",
                                                                                            "[UNK]")
    assert info["bos_token_id"] == 1 and info["pad_token_id"] == 0 and info["chat_template"] == config["chat_template"]
    assert info["max_model_len"] == CONTEXT and info["vocab_size"] == tok.vocab_size
    json.dumps(info)  # all of it JSON
    text = "the for statement repeats"
    with_bos = tokenize(dict(prompt=text), tok, "tiny", CONTEXT)["tokens"]
    assert with_bos == tok.encode(text).tolist() and with_bos[0] == 1
    assert tokenize(dict(prompt=text, add_special_tokens=False), tok, "tiny", CONTEXT)["tokens"] == with_bos[1:]
    assert detokenize(dict(tokens=with_bos), tok, "tiny", 260) == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", dict(prompt=5), "prompt"),
    ("/tokenize", dict(prompt=[1, 2]), "prompt"),
    ("/tokenize", dict(prompt="x", add_special_tokens="yes"), "add_special_tokens"),
    ("/tokenize", dict(prompt="x", messages=[dict(role="user", content="x")]), "messages"),
    ("/tokenize", dict(messages="hi"), "messages"),
    ("/tokenize", dict(messages=[dict(role="robot", content="x")]), "messages[0].role"),
    ("/tokenize", dict(messages=[dict(role="user", content="x")], add_generation_prompt=1), "add_generation_prompt"),
    ("/tokenize", dict(prompt="x", model="gpt-4"), "model"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", dict(tokens="abc"), "tokens"),
    ("/detokenize", dict(tokens=[1, 260]), "tokens"),
    ("/detokenize", dict(tokens=[-1]), "tokens"),
    ("/detokenize", dict(tokens=[1.5]), "tokens"),
    ("/detokenize", dict(tokens=[True]), "tokens"),
    ("/detokenize", dict(tokens=[10**30]), "tokens"),
    ("/detokenize", [1, 2], None),
])
def test_tokenizer_routes_bad_bodies_are_400(server, path, body, param):
    status, _, err = server.call(path, body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["param"] == param and (param is None or param.split("[")[0] in err["error"]["message"])


def test_tokenizer_routes_malformed_json_is_400(server):
    for path in ("/tokenize", "/detokenize"):
        status, _, err = server.call(path, b'{"prompt": ')
        assert status == 400 and "JSON" in err["error"]["message"]


# ---- the API key, CORS, the body limit ----------------------------------------------------------

GUARDED = [("/v1/models", None, "GET"), ("/v1/completions", dict(prompt="hi", max_tokens=1), "POST"),
           ("/v1/chat/completions", dict(messages=[dict(role="user", content="hi")], max_tokens=1), "POST"),
           ("/tokenize", dict(prompt="hi"), "POST"), ("/detokenize", dict(tokens=[104]), "POST"),
           ("/tokenizer_info", None, "GET")]


@pytest.mark.parametrize("path, body, method", GUARDED)
def test_api_key_is_required(server, path, body, method):
    for key, headers in ((None, {}), ("wrong-key", {}), (None, {"Authorization": KEY}),
                         (None, {"Authorization": f"Basic {KEY}"}), (KEY[:-1], {})):
        status, hdrs, err = server.call(path, body, key=key, method=method, headers=headers)
        assert status == 401 and err["error"]["type"] == "authentication_error", (key, headers)
        assert hdrs["WWW-Authenticate"] == "Bearer"
    status, _, _ = server.call(path, body, key=KEY, method=method)
    assert status == 200


def test_health_and_metrics_are_open_and_clients_authenticate(server):
    for path in ("/health", "/metrics"):
        assert server.call(path, key=None)[0] == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert [m.id for m in server.client.models.list()] == ["tiny"]


def test_cors_preflight_for_listed_origins_only(server):
    ask = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
    status, hdrs, _ = server.call("/v1/chat/completions", key=None, method="OPTIONS", headers=ask)
    assert status == 200 and hdrs["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in hdrs["Access-Control-Allow-Methods"]
    assert "authorization" in hdrs["Access-Control-Allow-Headers"].lower()
    status, hdrs, _ = server.call("/v1/chat/completions", key=None, method="OPTIONS",
                                  headers={**ask, "Origin": "http://evil.example"})
    assert status == 400 and "Access-Control-Allow-Origin" not in hdrs
    # simple requests carry the header too, a refused one included (the page can read the 401)
    status, hdrs, _ = server.call("/v1/models", key=None, method="GET", headers={"Origin": ORIGIN})
    assert status == 401 and hdrs["Access-Control-Allow-Origin"] == ORIGIN
    status, hdrs, _ = server.call("/v1/models", method="GET", headers={"Origin": ORIGIN})
    assert status == 200 and hdrs["Access-Control-Allow-Origin"] == ORIGIN


def raw_request(server, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send `head` (and `body`) on a fresh socket, never more; read the response to its end.
    (A server that waited for the rest of the body would never answer: the read times out.)"""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(60)
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


def test_body_over_the_limit_is_413(server):
    head = (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\n".encode())
    # by Content-Length, before any of the body is read: none is sent
    status, err = raw_request(server, head % b"/v1/completions" + f"Content-Length: {LIMIT + 1}\r\n\r\n".encode())
    assert status == 413 and str(LIMIT) in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    # a whole body one byte over
    body = json.dumps(dict(prompt="x" * LIMIT, max_tokens=1)).encode()
    status, err = raw_request(server, head % b"/v1/completions" + f"Content-Length: {len(body)}\r\n\r\n".encode(),
                              body)
    assert status == 413 and str(LIMIT) in err["error"]["message"]
    # chunked: a first chunk past the limit is refused without the rest (the last chunk never comes)
    chunk = b"[" + b" " * LIMIT
    status, err = raw_request(server, head % b"/tokenize" + b"Transfer-Encoding: chunked\r\n\r\n",
                              f"{len(chunk):x}\r\n".encode() + chunk)
    assert status == 413 and str(LIMIT) in err["error"]["message"]
    # a body of exactly the limit is served, and so is the next request
    body = json.dumps(dict(prompt="abc")).encode()
    body = body[:-1] + b" " * (LIMIT - len(body)) + b"}"
    status, _, r = server.call("/tokenize", body)
    assert len(body) == LIMIT and status == 200 and r["tokens"] == [97, 98, 99]
    still_serving(server)


def test_cli_flags(monkeypatch):
    from tinyloop_jax.cli import build_parser, edge_options

    monkeypatch.delenv("TINYLOOP_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    assert edge_options(args) == dict(api_key=None, cors_origins=(), max_body=4 << 20)
    monkeypatch.setenv("TINYLOOP_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--cors-origins", "http://a.example, http://b.example",
                                      "--max-body", "1024"])
    assert edge_options(args) == dict(api_key="from-env", cors_origins=("http://a.example", "http://b.example"),
                                      max_body=1024)
    assert edge_options(build_parser().parse_args(["serve", "--api-key", "k"]))["api_key"] == "k"
    parse = lambda *a: build_parser().parse_args(["serve", *a])  # noqa: E731
    assert (args.memory_budget, args.max_loops) == ("auto", None)
    assert parse("--memory-budget", "512M").memory_budget == 512 << 20
    assert parse("--kv-memory", "256M").memory_budget == 256 << 20  # the pages' budget, by its other name
    assert parse("--memory-budget", "1.5g").memory_budget == 3 << 29
    assert parse("--memory-budget", "4096").memory_budget == 4096
    assert parse("--memory-budget", "none", "--max-loops", "8").memory_budget is None
    for bad in ("lots", "0", "-1M"):
        with pytest.raises(SystemExit):
            parse("--memory-budget", bad)


# ---- penalties and logit_bias -------------------------------------------------------------------

def test_logit_bias_forces_and_forbids_tokens(model, server):
    ids = TOK.encode("def f(x):\n    return").tolist()
    greedy = complete(server, ids, max_tokens=8, ignore_eos=True).choices[0].token_ids
    assert greedy == model.generate(ids, max_tokens=8)[len(ids):]
    z = ord("z")
    assert z not in greedy
    forced = complete(server, ids, max_tokens=8, ignore_eos=True, logit_bias={str(z): 100}).choices[0].token_ids
    assert forced == [z] * 8 == model.generate(ids, max_tokens=8, logit_bias={z: 100})[len(ids):]
    banned = {str(greedy[0]): -100}
    out = complete(server, ids, max_tokens=8, ignore_eos=True, logit_bias=banned).choices[0].token_ids
    assert out[0] != greedy[0] and greedy[0] not in out
    assert out == model.generate(ids, max_tokens=8, logit_bias={greedy[0]: -100})[len(ids):]


def most_repeated(tokens) -> int:
    return max(Counter(tokens).values())


REPETITIVE = "abcabcabcabcabcabcabc"


@pytest.mark.parametrize("knob", ["presence_penalty", "frequency_penalty"])
def test_penalties_equal_generate_and_reduce_repetition(model, server, knob):
    ids = TOK.encode(REPETITIVE).tolist()
    plain = complete(server, ids, max_tokens=24, ignore_eos=True).choices[0].token_ids
    r = complete(server, ids, max_tokens=24, ignore_eos=True, **{knob: 2.0}).choices[0].token_ids
    assert r == model.generate(ids, max_tokens=24, **{knob: 2.0})[len(ids):]
    # penalized: fewer repeats of the favourite token, more distinct tokens
    assert most_repeated(r) < most_repeated(plain) and len(set(r)) > len(set(plain))
    r = complete(server, ids, max_tokens=24, ignore_eos=True, **{knob: -2.0}).choices[0].token_ids
    assert r == model.generate(ids, max_tokens=24, **{knob: -2.0})[len(ids):]
    # rewarded (a negative penalty): the other way
    assert most_repeated(r) > most_repeated(plain) and len(set(r)) < len(set(plain))


def test_chat_takes_penalties_and_logit_bias(model, server):
    messages = [dict(role="user", content=REPETITIVE)]
    ids = TOK.apply_chat_template(messages, tokenize=True).tolist()
    kw = dict(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={ord("q"): 5.0})
    r = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                              logit_bias={str(t): b for t, b in kw["logit_bias"].items()},
                                              **{k: v for k, v in kw.items() if k != "logit_bias"},
                                              extra_body=dict(ignore_eos=True))
    assert r.choices[0].message.content == TOK.decode(model.generate(ids, max_tokens=10, **kw)[len(ids):])


# ---- every bad value is a 400 naming it ---------------------------------------------------------

BAD = [
    (dict(max_tokens=10**12), "max_tokens"),
    (dict(max_tokens=2**31), "max_tokens"),
    (dict(max_tokens=-(10**30)), "max_tokens"),
    (dict(max_tokens=1e3), "max_tokens"),
    (dict(max_tokens=CONTEXT), "max_tokens"),  # prompt + max_tokens past the context
    (dict(loops=10**9), "loops"),
    (dict(loops=65), "loops"),  # above the engine's max_loops (64)
    (dict(loops=0), "loops"),
    (dict(loops="3"), "loops"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"),
    (dict(seed=2**80), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(n=1.5), "n"),
    (dict(n="2"), "n"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=float("inf")), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=10**12), "top_k"),  # past int32: was a 500 from the batch step
    (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty="x"), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias=[[1, 2]]), "logit_bias"),
    (dict(logit_bias="x"), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"1.5": 1}), "logit_bias"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"5": "1"}), "logit_bias"),
    (dict(logit_bias={"5": float("nan")}), "logit_bias"),
    (dict(logit_bias={"260": 1}), "logit_bias"),  # outside the vocabulary
    (dict(logit_bias={"-1": 1}), "logit_bias"),
    (dict(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    (dict(stop=5), "stop"),
    (dict(stream="yes"), "stream"),
    (dict(stream_options=5), "stream_options"),
    (dict(ignore_eos="no"), "ignore_eos"),
]


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("body, param", BAD)
def test_bad_values_are_400_naming_the_param(server, route, body, param):
    if route == "completions":
        path, base = "/v1/completions", dict(model="tiny", prompt="hi", max_tokens=2)
    else:
        path, base = "/v1/chat/completions", dict(model="tiny", messages=[dict(role="user", content="hi")],
                                                  max_tokens=2)
    status, _, err = server.call(path, {**base, **body})
    assert status == 400, err
    assert err["error"]["param"] == param and param in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"


def test_bad_values_leave_the_server_serving(server):
    for body, _ in BAD[:6]:
        server.call("/v1/completions", dict(prompt="hi", **body))
    still_serving(server)


@pytest.mark.parametrize("body, param", [(dict(max_completion_tokens=10**12), "max_completion_tokens"),
                                         (dict(max_completion_tokens=0), "max_completion_tokens"),
                                         (dict(messages=[dict(role="user", content="x" * CONTEXT)]), "messages")])
def test_bad_chat_values_are_400_naming_the_param(server, body, param):
    base = dict(model="tiny", messages=[dict(role="user", content="hi")])
    status, _, err = server.call("/v1/chat/completions", {**base, **body})
    assert status == 400 and err["error"]["param"] == param and param in err["error"]["message"]


def test_prompt_ids_outside_the_vocabulary_are_400(server):
    status, _, err = server.call("/v1/completions", dict(prompt=[1, 2, 260], max_tokens=2))
    assert status == 400 and err["error"]["param"] == "prompt" and "260" in err["error"]["message"]


def test_request_past_the_memory_budget_is_400_and_no_key_or_cors_by_default(model):
    s = Server(model, max_batch=1, memory_budget=1)  # no request can fit one byte
    try:
        status, hdrs, err = s.call("/v1/completions", dict(prompt="hi", max_tokens=2), key=None,
                                   headers={"Origin": ORIGIN})
        msg = err["error"]["message"]
        assert status == 400 and "memory_budget=1 bytes holds 0 pages (0 tokens)" in msg, msg
        assert "a request of 2 + 2 tokens" in msg and "needs 1 pages (16 tokens)" in msg and "--memory-budget" in msg
        assert err["error"]["type"] == "invalid_request_error"
        assert "Access-Control-Allow-Origin" not in hdrs  # no CORS unless origins are listed
        assert s.call("/tokenize", dict(prompt="hi"), key=None)[0] == 200  # no key configured: open
    finally:
        s.close()


# ---- /metrics: per-depth counters ---------------------------------------------------------------

def scrape(server) -> dict:
    """{(sample name, loops label): value} of the per-depth families."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, text = server.call("/metrics", key=None, method="GET")
    assert status == 200
    return {(s.name, s.labels["loops"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "loops" in s.labels}


def test_metrics_count_prefix_cache_and_passes_per_depth(server):
    names = ("tinyloop_prefix_cache_queries_total", "tinyloop_prefix_cache_hits_total",
             "tinyloop_tokens_computed_total", "tinyloop_passes_total")
    prompt = "A shared system prompt, longer than one 32-token chunk: "  # the first's pages: read by the second
    before = scrape(server)
    complete(server, prompt + "first", max_tokens=3, ignore_eos=True, loops=2)
    middle = scrape(server)
    second = complete(server, prompt + "second", max_tokens=3, ignore_eos=True, loops=2)
    after = scrape(server)
    delta = lambda a, b, n: b.get((n, "2"), 0) - a.get((n, "2"), 0)  # noqa: E731
    n1, n2 = len(TOK.encode(prompt + "first")), len(TOK.encode(prompt + "second"))
    assert delta(before, middle, names[0]) == n1 and delta(middle, after, names[0]) == n2  # queries: prompt tokens
    hits = delta(middle, after, names[1])
    assert hits == second.usage.prompt_tokens_details.cached_tokens and len(TOK.encode(prompt)) <= hits < n2
    for a, b in ((before, middle), (middle, after)):
        assert delta(a, b, names[3]) == 2 * delta(a, b, names[2]) > 0  # loops=2: two passes per position
    # the default depth has its own label; every value is the engine's own count
    stats = server.engine.stats()["depths"]
    for loops, d in stats.items():
        for n in names:
            assert after[(n, str(loops))] == d[n.removeprefix("tinyloop_").removesuffix("_total")]
    assert {"2", "3"} <= {label for _, label in after}


# ---- OpenAI's message parts and the readiness probe ----------------------------------------------

def test_content_as_text_parts_equals_the_string(model, server):
    """Content as an array of text parts (what many clients and agent frameworks send) answers as
    the parts' text joined by newlines; any other part type is a 400 naming it."""
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body=dict(ignore_eos=True))
    plain = server.client.chat.completions.create(
        messages=[dict(role="system", content="Be brief."), dict(role="user", content="Say hi\nthen bye")], **kw)
    parts = server.client.chat.completions.create(messages=[
        dict(role="system", content=[dict(type="text", text="Be brief.")]),
        dict(role="user", content=[dict(type="text", text="Say hi"), dict(type="text", text="then bye")])], **kw)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    image = dict(type="image_url", image_url=dict(url="data:image/png;base64,AAAA"))
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[1\] is a 'image_url' part") as e:
        server.client.chat.completions.create(
            messages=[dict(role="user", content=[dict(type="text", text="What is this?"), image])], **kw)
    assert e.value.body["param"] == "messages[0].content[1]"
    still_serving(server)


def test_health_is_503_while_warming_then_200(model):
    """/health answers 503 {"status": "warming"} while the background warmup compiles (requests
    are served meanwhile), then 200 {"status": "ok"}: a readiness probe waits for it."""
    s = Server(model, max_batch=1)
    try:
        s.engine.warmup(background=True)
        seen = []
        while True:
            was = s.engine.warming  # (read before the call: the warmup may end while it is answered)
            status, _, body = s.call("/health", key=None)
            seen.append((status, body["status"]))
            if status == 200:
                break
            assert was and body == {"status": "warming", "warming": True}, body  # (503 only while warming)
            time.sleep(0.05)
        assert seen[0] == (503, "warming") and seen[-1] == (200, "ok") and not s.engine.warming
    finally:
        s.close()


def test_health_says_stalled_when_the_engine_stops_stepping(model, monkeypatch):
    """A liveness probe's cue: with a request waiting and no loop iteration for longer than the
    bound, `Engine.stalled` names it and /health is 503 {"status": "stalled"}; once the loop
    steps again, 200; a closed engine's loop has stopped. (The loop is held by a job of its own.)"""
    import threading

    s = Server(model, max_batch=1)
    try:
        gate = threading.Event()
        with s.engine._cv:  # the loop's next iteration runs this job first, and waits in it
            s.engine._jobs.append(gate.wait)
            s.engine._cv.notify_all()
        h = s.engine.submit([1, 2, 3], max_tokens=2)
        time.sleep(0.3)
        assert s.engine.stalled() is None  # (under the default bound)
        why = s.engine.stalled(after_s=0.1)
        assert why is not None and "no step" in why, why
        with monkeypatch.context() as m:
            m.setattr("tinyloop_jax.serving.engine.STALL_S", 0.1)
            status, _, body = s.call("/health", key=None)
            assert (status, body["status"]) == (503, "stalled") and "no step" in body["reason"], body
        gate.set()
        assert len(h.result(timeout=60)) == 5
        status, _, body = s.call("/health", key=None)
        assert status == 200 and s.engine.stalled() is None, body
    finally:
        s.close()
    assert "stopped" in s.engine.stalled()
