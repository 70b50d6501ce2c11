"""Engines behind streams (`serving/replica.py`, issue 61): the HTTP app over a `RemoteEngine`
whose replica is an `EngineReplica` in this process, every request and message pickled on the
way as Ray Serve carries them. Through the `openai` client the answers equal `model.generate`'s
(greedy, sampled, streamed, a grammar, n = 2); a replica's refusal is the single process's 400;
a closed stream frees the replica's row."""

import asyncio
import pickle
import threading
import time

import pytest
from conftest import tiny_config

import tinyloop_jax as tl
from tinyloop_jax.api.request import from_keywords
from tinyloop_jax.serving.protocol import choice_seed
from tinyloop_jax.serving.replica import EngineReplica, RemoteEngine, portable, restored

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra installs uvicorn")
from tinyloop_jax.serving.app import make_app  # noqa: E402

TOK = tl.ByteTokenizer()
V = 260


@pytest.fixture(scope="module")
def served():
    model = tl.Model.random(tiny_config(vocab_size=V), seed=3)
    engine = tl.Engine(model, max_batch=4, max_loops=4)
    replica = EngineReplica(engine, TOK)

    async def open_stream(request):  # what Ray Serve does between processes, here in one
        text = TOK.decode(list(request.prompt))
        if text.startswith("DEAD"):  # a replica gone before it queued the request
            raise ConnectionError("the replica's actor died")
        async for msg in replica.generate(pickle.loads(pickle.dumps(request))):
            yield pickle.loads(pickle.dumps(msg))
            if text.startswith("DYING") and "accepted" in msg:  # one that dies while it serves it
                raise ConnectionError("the replica's actor died")

    remote = RemoteEngine(model, open_stream, max_loops=8)
    server = uvicorn.Server(uvicorn.Config(make_app(remote, TOK, "tiny", eos=[TOK.EOS]), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
    yield model, engine, openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join()
    engine.close()


def test_answers_through_a_replica_equal_generate(served):
    model, engine, client = served
    ids = TOK.encode("def f(x):\n    return")
    for kw in (dict(), dict(temperature=0.8, seed=5, top_k=0)):  # (the server samples with top_k 0)
        r = client.completions.create(model="tiny", prompt="def f(x):\n    return", max_tokens=8,
                                      temperature=kw.get("temperature", 0.0), seed=kw.get("seed"),
                                      extra_body=dict(ignore_eos=True))
        want = model.generate(ids, max_tokens=8, **kw)[len(ids):]
        assert r.choices[0].token_ids == want and r.choices[0].finish_reason == "length"
        chunks = client.completions.create(model="tiny", prompt="def f(x):\n    return", max_tokens=8, stream=True,
                                           temperature=kw.get("temperature", 0.0), seed=kw.get("seed"),
                                           extra_body=dict(ignore_eos=True))
        assert "".join(c.choices[0].text for c in chunks) == TOK.decode(want)
    # a grammar crosses as its spec and is compiled there for the replica's tokenizer
    rf = {"type": "regex", "regex": "[0-9]{2,3}(-[a-f]{2})?"}
    r = client.completions.create(model="tiny", prompt="The answer: ", max_tokens=10, n=2, temperature=0.9, seed=1,
                                  extra_body=dict(structured_outputs=dict(regex=rf["regex"])))
    g = tl.Grammar.of(rf, TOK, V)
    p = TOK.encode("The answer: ")
    kw = dict(max_tokens=10, temperature=0.9, top_k=0, response_format=g, stop_sequences=[[TOK.EOS]])
    assert [c.token_ids for c in r.choices] == [model.generate(p, seed=choice_seed(1, j), **kw)[len(p):]
                                                for j in (0, 1)]


def test_a_replicas_refusal_is_the_single_process_400_and_a_dead_replica_a_503(served):
    model, engine, client = served
    with pytest.raises(openai.BadRequestError, match="max_loops=4"):  # the ingress allows 8; the replica 4
        client.completions.create(model="tiny", prompt="abc", max_tokens=3, extra_body=dict(loops=6))
    for prompt in ("DEAD abc", "DYING abc"):
        with pytest.raises(openai.InternalServerError, match="actor died") as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
        assert e.value.status_code == 503
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=3)  # the others serve on
    assert r.choices[0].text is not None and r.system_fingerprint == f"tinyloop-{replica_name()}"
    # the ingress's /metrics: what it saw of each replica (the failures under no replica's name)
    import urllib.request

    text = urllib.request.urlopen(str(client.base_url).replace("/v1/", "/metrics")).read().decode()
    metric = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] != "#"}
    name = replica_name()
    assert metric[f'tinyloop_replica_requests_total{{replica="{name}"}}'] >= 2
    assert metric['tinyloop_replica_requests_failed_total{replica="(none)"}'] >= 1  # (gone before it was queued)
    assert metric["tinyloop_requests_total"] == sum(v for k, v in metric.items()
                                                    if k.startswith("tinyloop_replica_requests_total"))


def replica_name() -> str:
    import os
    import socket

    return f"{socket.gethostname()}-{os.getpid()}"


def test_the_request_value_crosses_whole_and_a_closed_stream_frees_the_row(served):
    model, engine, client = served
    g = tl.Grammar.of({"type": "choice", "choice": ["north", "south"]}, TOK, V)
    req = from_keywords(TOK.encode("Go "), max_tokens=5, temperature=0.5, seed=3, response_format=g,
                                       loops=2)
    back = restored(pickle.loads(pickle.dumps(portable(req))), TOK, V)
    assert back.params == req.params and back.plan == req.plan and list(back.prompt) == list(req.prompt)

    async def abandon():
        remote = RemoteEngine(model, EngineReplica(engine, TOK).generate, max_loops=4)
        h = remote.submit(from_keywords(TOK.encode("abc"), max_tokens=120))
        await h.aaccepted()
        async for _ in h.astream():
            break
        h.cancel()
        while not h.done:
            await asyncio.sleep(0.01)
        return h

    before = engine.stats().get("finished_cancelled", 0)
    h = asyncio.run(abandon())
    assert h.finish_reason == "cancelled" and len(h.tokens) < 120
    deadline = time.time() + 30  # the replica's engine cancelled it (it did not run to its 120 tokens)
    while engine.stats().get("finished_cancelled", 0) == before and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats().get("finished_cancelled", 0) == before + 1 and engine.stats()["running"] == 0
