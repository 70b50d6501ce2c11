"""`tinyloop serve`'s HTTP API, started on a free localhost port and driven by the official
`openai` client: completions equal `model.generate`, streaming, concurrency, errors, metrics.
(`Server` also serves tests/test_chat.py.)"""

import http.client
import json
import re
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import no_suite_allocator, tiny_config

import tinyloop_jax as tl
from tinyloop_jax import settings

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra installs uvicorn")

from tinyloop_jax.serving.app import make_app  # noqa: E402

TOK = tl.ByteTokenizer()
EOS = tl.ByteTokenizer.EOS


@pytest.fixture(scope="module")
def model():
    return tl.Model.random(tiny_config(vocab_size=260), seed=3)  # byte vocabulary


class Server:
    def __init__(self, model, eos=(EOS,), tok=TOK, name="tiny", app_kw=None, api_key="unused", **engine_kw):
        self.engine = tl.Engine(model, **engine_kw)  # (no warmup: the tests compile what they use)
        app = make_app(self.engine, tok, name, eos=list(eos), **(app_kw or {}))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.close()

    def post_raw(self, body: bytes, path: str = "/v1/completions") -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, max_batch=4)
    yield s
    s.close()


def complete(server, prompt, **kw):
    extra = {k: kw.pop(k) for k in ("top_k", "repetition_penalty", "loops", "ignore_eos") if k in kw}
    extra.update(kw.pop("extra_body", {}))
    return server.client.completions.create(model="tiny", prompt=prompt, temperature=kw.pop("temperature", 0.0),
                                            extra_body=extra or None, **kw)


PROMPTS = ["The \"for\" statement\n", "The \"for\" statement\nis used", "def f(x):\n    return",
           "Boolean operations\n", "import os\nimport sys\n", "class A:\n    pass\n"]


def test_completions_equal_generate(model, server):
    for i, text in enumerate(PROMPTS[:4]):
        kw = dict(max_tokens=6 + i, ignore_eos=True)
        if i == 3:
            kw.update(temperature=0.7, seed=11, top_k=30, top_p=0.9, repetition_penalty=1.2, loops=2)
        r = complete(server, text, **kw)
        ids = TOK.encode(text)
        want = model.generate(ids, max_tokens=kw["max_tokens"], temperature=kw.get("temperature", 0.0),
                              top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0), seed=kw.get("seed", 0),
                              repetition_penalty=kw.get("repetition_penalty", 1.0), loops=kw.get("loops"))[len(ids):]
        c = r.choices[0]
        assert c.token_ids == want and c.text == TOK.decode(want)
        assert c.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want))
    # a list of token ids is a prompt too
    r = complete(server, [70, 71, 72], max_tokens=5, ignore_eos=True)
    assert r.choices[0].token_ids == model.generate([70, 71, 72], max_tokens=5)[3:]


def test_stops_and_eos(model):
    ids = TOK.encode(PROMPTS[2])
    want = model.generate(ids, max_tokens=12)[len(ids):]
    srv = Server(model, eos=(want[4],), max_batch=4)  # the model "ends its text" at its 5th token
    try:
        r = complete(srv, PROMPTS[2], max_tokens=12)
        assert r.choices[0].token_ids == want[:5] and r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == TOK.decode(want[:4])
        r = complete(srv, PROMPTS[2], max_tokens=12, ignore_eos=True)
        assert r.choices[0].token_ids == want and r.choices[0].finish_reason == "length"
        text = TOK.decode(want)
        stop = next(text[i:i + 2] for i in range(2, len(text) - 1) if "\ufffd" not in text[i:i + 2])
        r = complete(srv, PROMPTS[2], max_tokens=12, ignore_eos=True, stop=[stop, "never"])  # ends before it
        assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"
        assert len(r.choices[0].token_ids) < 12
    finally:
        srv.close()


def test_stream_equals_non_stream(server):
    for text in PROMPTS[:3]:
        for kw in (dict(max_tokens=10, ignore_eos=True), dict(max_tokens=10, ignore_eos=True, stop=["TT", "Q"])):
            full = complete(server, text, **kw).choices[0]
            parts = list(complete(server, text, stream=True, **kw))
            assert "".join(p.choices[0].text for p in parts) == full.text
            assert sum((p.choices[0].token_ids for p in parts), []) == full.token_ids
            assert parts[-1].choices[0].finish_reason == full.finish_reason
            assert all(p.choices[0].finish_reason is None for p in parts[:-1])


def test_concurrent_clients_equal_sequential(server):
    rng = np.random.default_rng(0)
    jobs = [(PROMPTS[i % len(PROMPTS)] + str(i), int(rng.integers(3, 12))) for i in range(12)]
    run = lambda job: complete(server, job[0], max_tokens=job[1], ignore_eos=True).choices[0].token_ids  # noqa: E731
    sequential = [run(j) for j in jobs]
    with ThreadPoolExecutor(12) as pool:
        concurrent = list(pool.map(run, jobs))
    assert concurrent == sequential


@pytest.mark.parametrize("body, param", [
    (dict(prompt="hi", max_tokens="5"), "max_tokens"),
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="x" * 120, max_tokens=20), "max_seq_len"),
    (dict(prompt=[1, 2, 999], max_tokens=2), "999"),
    (dict(prompt=[1, -2], max_tokens=2), "-2"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=0), "top_p"),
    (dict(prompt=5), "prompt"),
    (dict(prompt="hi", stream="yes"), "stream"),
    (dict(prompt="hi", n=0), "n must be"),
    (dict(prompt="hi", n=3, best_of=2), "best_of"),
    (dict(prompt="hi", n=2, best_of=3, stream=True), "best_of"),
    (dict(prompt="hi", logprobs=21), "logprobs"),
    (dict(prompt="hi", logprobs=2, stream=True), "logprobs"),
    (dict(prompt=["hi", 5]), "prompt[1]"),
    (dict(prompt=["hi"] * 65, n=2), "choices"),
    (dict(prompt="hi", stop=[""]), "stop"),
    (dict(prompt="hi", loops=0), "loops"),
    (dict(prompt="hi", exit_criterion="nope"), "exit_criterion"),
    (dict(prompt="hi", exit_criterion="kl", check_every=0), "check_every"),
    (dict(prompt="hi", exit_criterion="kl", exit_threshold=-1), "exit_threshold"),
    (dict(prompt="hi", exit_in_prefill=True), "exit_in_prefill"),
    (dict(prompt="hi", exit_criterion="kl", exit_in_prefill="yes"), "exit_in_prefill"),
    (dict(prompt="hi", model="gpt-4"), "gpt-4"),
    (dict(prompt="hi", draft_loops=99), "draft_loops"),
    (dict(prompt="hi", draft_loops=1, lookahead=0), "lookahead"),
    (dict(max_tokens=3), "prompt"),
])
def test_bad_requests_are_400(server, body, param):
    status, err = server.post_raw(json.dumps(dict(dict(model="tiny", temperature=0), **body)).encode())
    assert status == 400 and param in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    assert complete(server, "ok", max_tokens=2).choices[0].finish_reason in ("length", "stop")  # still serving


def test_adaptive_depth_extras_equal_generate(model, server):
    """exit_criterion and its knobs as extras: the completion equals `generate` with them, and
    /metrics counts the passes the exits skipped."""
    kw = dict(exit_criterion="entropy-diff", exit_threshold=1e-2, min_steps=0)
    before = server.engine.stats()["depths"].get(model.weights.config.default_loops, {}).get("passes_skipped", 0)
    r = complete(server, "The \"for\" statement\n", max_tokens=7, ignore_eos=True, extra_body=kw)
    ids = TOK.encode("The \"for\" statement\n")
    want = model.generate(ids, max_tokens=7, **kw)
    assert r.choices[0].token_ids == want[len(ids):]
    skipped = sum(model.weights.config.default_loops - d for d in model.last_passes)
    after = server.engine.stats()["depths"][model.weights.config.default_loops]["passes_skipped"]
    assert after - before == skipped
    metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert "tinyloop_passes_skipped_total" in metrics
    kw.update(exit_in_prefill=True)  # the prompt one chunk that exits as a whole, as generate's
    r = complete(server, "The \"for\" statement\n", max_tokens=7, ignore_eos=True, extra_body=kw)
    assert r.choices[0].token_ids == model.generate(ids, max_tokens=7, **kw)[len(ids):]


def test_speculative_extras_equal_generate(model, server):
    """draft_loops / lookahead as extras: the completion equals `generate` (greedy: plain
    decoding's tokens)."""
    ids = TOK.encode("The \"for\" statement\n")
    r = complete(server, "The \"for\" statement\n", max_tokens=9, ignore_eos=True,
                 extra_body=dict(draft_loops=1, lookahead=3))
    assert r.choices[0].token_ids == model.generate(ids, max_tokens=9)[len(ids):]


def test_malformed_json_and_client_errors(server):
    status, err = server.post_raw(b'{"prompt": "hi", "max_tokens": ')
    assert status == 400 and "JSON" in err["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        complete(server, "hi", max_tokens=-1)
    assert complete(server, "ok", max_tokens=2).usage.completion_tokens >= 1


def test_disconnect_frees_the_row(server):
    before = server.engine.stats().get("finished_cancelled", 0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v1/completions", json.dumps(dict(model="tiny", prompt="abc", max_tokens=100,
                                                           ignore_eos=True, stream=True, temperature=0)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()  # mid-stream
    deadline = time.time() + 20
    while server.engine.stats().get("finished_cancelled", 0) == before and time.time() < deadline:
        time.sleep(0.05)
    assert server.engine.stats()["finished_cancelled"] == before + 1
    assert server.engine.stats()["running"] == 0


def test_models_health_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, "ok", max_tokens=2)  # (whichever tests ran before on this worker)
    assert [m.id for m in server.client.models.list()] == ["tiny"]
    with urllib.request.urlopen(server.url + "/health") as r:
        assert json.load(r)["status"] == "ok"
    with urllib.request.urlopen(server.url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for name in ("tinyloop_requests", "tinyloop_tokens_in", "tinyloop_tokens_out", "tinyloop_prefix_hit_rate",
                 "tinyloop_queue_depth", "tinyloop_mean_batch_size", "tinyloop_ttft_p50_s",
                 "tinyloop_tokens_per_second", "tinyloop_requests_finished"):
        assert name in families, name
    value = lambda n: families[n].samples[0].value  # noqa: E731
    assert value("tinyloop_requests") >= 1 and value("tinyloop_tokens_out") >= 1


def start_serve(folder, *flags, env=None):
    """`tinyloop serve --model folder` in a subprocess on a free port: (process, port, get(path))."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop_jax.cli", "serve", "--model", str(folder),
                             "--port", str(port), "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    def get(path):  # (the body of a 503 too: /health while warming)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
                return r.read().decode()
        except urllib.error.HTTPError as e:
            if e.code != 503:
                raise
            return e.read().decode()

    return proc, port, get


def wait_health(proc, get, deadline: float) -> dict:
    while True:
        try:
            return json.loads(get("/health"))
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-2000:]
            time.sleep(0.2)


def test_tinyloop_serve_command(model, tmp_path):
    """`tinyloop serve` as a user starts it: a saved model folder, 127.0.0.1 by default."""
    from tinyloop_jax.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.max_batch) == ("127.0.0.1", 8000, 16)
    model.save(str(tmp_path / "tiny"))
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"))  # a cold compilation cache
    t0 = time.time()
    proc, port, get = start_serve(tmp_path / "tiny", "--max-batch", "2", env=env)
    try:
        deadline = time.time() + 240
        health = wait_health(proc, get, deadline)
        t_health = time.time() - t0
        assert health["status"] == ("warming" if health["warming"] else "ok")  # (503 while warming)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})  # served while the warmup may still run
        t_first = time.time() - t0
        assert r.choices[0].token_ids == model.generate(TOK.encode("abc"), max_tokens=4)[3:]
        while json.loads(get("/health"))["warming"]:  # the background warmup ends ...
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        r = client.completions.create(model="tiny", prompt="a longer prompt than before", max_tokens=3,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert len(r.choices[0].token_ids) == 3
        # ... and covered what that request ran
        assert "tinyloop_compiles_after_warmup_total 0.0" in get("/metrics")
        print(f"cold start: /health after {t_health:.1f} s, first completion after {t_first:.1f} s")
    finally:
        proc.terminate()
        proc.wait(30)
    said = proc.stdout.read().decode()  # what the budget holds, printed at start
    assert re.search(r"memory budget [0-9,]+ MiB \(auto\): [0-9,]+ tokens at loops=3, 2 requests of 128", said), said


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_a_loops_sweep_over_http_stays_within_the_memory_budget(model, tmp_path):
    """A client sweeping `loops` from 1 to 64 against `tinyloop serve --max-depths 3 --memory-budget
    16M`: every depth holds a page pool, request rows and its compiled programs; every
    request is answered, the depths' bytes stay within the budget, idle depths are
    evicted with their programs, so the server's RSS stops growing once 3 depths are held (it
    grew by every depth's programs before), and it keeps serving. 8 depths spread over 1..64,
    the deepest included (each depth compiles its programs: a few seconds)."""
    model.save(str(tmp_path / "tiny"))
    budget = 16 << 20
    proc, port, get = start_serve(tmp_path / "tiny", "--max-batch", "1", "--memory-budget", "16M", "--max-loops", "64",
                                  "--max-depths", "3", env=no_suite_allocator())  # (its own allocator, as users')

    def metric(name: str) -> float:
        return float(next(line.split()[-1] for line in get("/metrics").splitlines() if line.startswith(name)))

    try:
        deadline = time.time() + 240
        wait_health(proc, get, deadline)
        with open(f"/proc/{proc.pid}/maps") as f, open(f"/proc/{proc.pid}/environ", "rb") as e:
            maps, environ = f.read(), e.read().split(b"\0")
        if settings.jemalloc():  # started again (the same process) under jemalloc, with the server's options
            assert "jemalloc" in maps and f"MALLOC_CONF={settings.JEMALLOC_CONF}".encode() in environ
        while json.loads(get("/health"))["warming"]:  # (its compiles would blur the RSS)
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        depths = [1, 2, 4, 8, 16, 32, 48, 64]
        rss, held = [], []
        for loops in depths:
            r = client.completions.create(model="tiny", prompt=f"depth {loops}: ", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True, "loops": loops})
            assert len(r.choices[0].token_ids) == 3
            rss.append(rss_bytes(proc.pid))
            held.append(metric("tinyloop_memory_bytes"))
            assert metric("tinyloop_depths_held ") <= 3
        evicted = metric("tinyloop_depths_evicted")
        mib = [x >> 20 for x in rss]
        print(f"RSS (MiB) after each depth: {mib}; depths held <= {max(held) / 2**20:.1f} MiB of the "
              f"{budget >> 20} MiB budget; {evicted:.0f} depths evicted")
        assert max(held) <= budget and evicted >= len(depths) - 3
        assert max(rss[4:]) - rss[3] <= 64 << 20, mib  # flat once 3 depths are held (4 more depths)
        r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].token_ids == model.generate(TOK.encode("abc"), max_tokens=4)[3:]
    finally:
        proc.terminate()
        proc.wait(30)


# ---- several prompts, n / best_of, echo and logprobs --------------------------------------------

def test_a_list_of_prompts_equals_single_requests(model, server):
    prompts = [TOK.encode(p).tolist() for p in PROMPTS[:3]]
    r = complete(server, prompts, max_tokens=5, ignore_eos=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for p, c in zip(prompts, r.choices):
        assert c.token_ids == complete(server, p, max_tokens=5, ignore_eos=True).choices[0].token_ids
        assert c.token_ids == model.generate(p, max_tokens=5)[len(p):]
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 15
    texts = complete(server, PROMPTS[:2], max_tokens=4, ignore_eos=True)  # strings too
    assert [c.text for c in texts.choices] == [complete(server, p, max_tokens=4, ignore_eos=True).choices[0].text
                                               for p in PROMPTS[:2]]


def test_n_choices_share_the_prompt(model, server):
    long = PROMPTS[1] * 2  # longer than a pool's short rest: the other choices read it from the pool
    greedy = complete(server, long, max_tokens=6, n=4, ignore_eos=True)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in greedy.choices}) == 1
    assert max(greedy.usage.prompt_tokens_details.cached_tokens, 0) > 0
    kw = dict(max_tokens=8, n=4, temperature=1.0, seed=5, ignore_eos=True)
    a, b = complete(server, long, **kw), complete(server, long, **kw)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]  # reproducible per seed
    assert len({tuple(c.token_ids) for c in a.choices}) > 1  # each choice its own seed stream
    one = complete(server, long, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert a.choices[0].token_ids == one.choices[0].token_ids  # choice 0 samples as n = 1 does
    # best_of: the n likeliest per token of best_of candidates
    best = complete(server, long, max_tokens=8, n=2, best_of=4, temperature=1.0, seed=5, ignore_eos=True,
                    logprobs=0)
    scored = complete(server, long, logprobs=0, **kw)
    assert [c.token_ids for c in scored.choices] == [c.token_ids for c in a.choices]
    means = sorted((np.mean(c.logprobs.token_logprobs) for c in scored.choices), reverse=True)[:2]
    np.testing.assert_allclose([np.mean(c.logprobs.token_logprobs) for c in best.choices], means, atol=1e-5)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_echo_and_logprobs_as_lm_eval_asks(model, server):
    """lm-evaluation-harness's loglikelihood request: context + continuation ids, max_tokens 1,
    echo, logprobs 1, temperature 0 -> prompt length + 1 entries, the generated token last."""
    ids = TOK.encode(PROMPTS[2]).tolist()
    r = server.client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                         temperature=0, extra_body=dict(ignore_eos=True))
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert c.text == PROMPTS[2] + TOK.decode(c.token_ids) and "".join(lp.tokens) == c.text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    full = ids + c.token_ids
    for i in range(1, len(full)):  # the model's own log-probabilities: log-softmax of the raw logits
        want = log_softmax(model.next_token_logits(full[:i]))
        np.testing.assert_allclose(lp.token_logprobs[i], want[full[i]], atol=1e-4)
        assert lp.top_logprobs[i] and max(lp.top_logprobs[i].values()) == pytest.approx(want.max(), abs=1e-4)
    # greedy: the generated token is the top one
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    # sampling knobs do not change them; a cached prefix does not either
    again = server.client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                             temperature=0, extra_body=dict(ignore_eos=True, top_k=3))
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
    # max_tokens 0 with echo: the prompt's log-probabilities alone
    zero = server.client.completions.create(model="tiny", prompt=[ids], max_tokens=0, echo=True, logprobs=2)
    assert zero.choices[0].text == PROMPTS[2] and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert all(len(d) >= 2 for d in zero.choices[0].logprobs.top_logprobs[1:])


def test_logprobs_without_echo_cover_the_completion(model, server):
    r = complete(server, PROMPTS[0], max_tokens=5, logprobs=3, ignore_eos=True)
    c, ids = r.choices[0], TOK.encode(PROMPTS[0]).tolist()
    assert len(c.logprobs.token_logprobs) == 5 and c.logprobs.text_offset[0] == 0
    s = model.score(ids + c.token_ids, top_logprobs=3)
    np.testing.assert_allclose(c.logprobs.token_logprobs, s.logprobs[len(ids):], atol=1e-5)
    # the top 3 and the token itself, keyed by text (bytes >= 128 all read U+FFFD, so keys may merge)
    assert all(1 <= len(d) <= 4 for d in c.logprobs.top_logprobs)
    assert all(t in d for t, d in zip(c.logprobs.tokens, c.logprobs.top_logprobs))


def test_streamed_choices_interleave_by_index(server):
    kw = dict(max_tokens=6, n=2, temperature=1.0, seed=9, ignore_eos=True)
    whole = complete(server, PROMPTS[:2], **kw)
    texts, finish = {}, {}
    for chunk in complete(server, PROMPTS[:2], stream=True, echo=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and finish == {i: "length" for i in range(4)}
    assert [texts[i] for i in range(4)] == [PROMPTS[i // 2] + c.text for i, c in enumerate(whole.choices)]
