"""Two engine replicas of the bundled model on Ray Serve behind the ingress (`serving/ray_app.py`,
issue 61), a local Ray instance, through the `openai` client: greedy answers equal the single
process server's; a request sharing a cached prompt's pages goes where they are (its cached
tokens and the replica's name reported); each replica's engine counters reach the ingress's
/metrics; a killed replica's request is a 503, then the deployment serves again."""

import functools
import threading
import time
import urllib.request

import numpy as np
import pytest
from conftest import tiny_model
from test_server import Server

import tinyloop_jax as tl
from tinyloop_jax import cli
from tinyloop_jax.formats.tokenizer import tokenizer_for

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
# (Ray's own pydantic fields, and its process spawns: fork + exec, which JAX's fork warning does not tell apart)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
              pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")]
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

SYSTEM = "You answer questions about Python's standard library, briefly. " * 2  # 8 full pages of bytes
QUESTIONS = ["What does os.path.join do?", "Name a list method.", "What is a generator?"]
MAX_LOOPS = 32


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from tinyloop_jax.serving.ray_app import build_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options=dict(host="127.0.0.1", port=port))
    load = functools.partial(cli.model_and_tokenizer_of, None)
    serve.run(build_app(load, replicas=2, router="prefix", cores_per_replica=1, name="pydoc",
                        eos=[tl.ByteTokenizer.EOS], max_loops=MAX_LOOPS, engine_kwargs=dict(max_batch=4),
                        tokenizer=functools.partial(tokenizer_for, None)),  # (an ingress without weights)
              route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def single():
    model, tok = cli.model_and_tokenizer_of(None)
    s = Server(model, eos=(tl.ByteTokenizer.EOS,), tok=tok, name="pydoc", max_batch=4)
    yield s
    s.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(client, prompt, **kw):
    return client.completions.create(model="pydoc", prompt=prompt, temperature=0.0,
                                     extra_body=dict(ignore_eos=True, **kw.pop("extra", {})), **kw)


def _metrics(url: str) -> dict:
    """/metrics as {name{labels}: value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _until(cond, timeout=120.0, every=0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def test_two_replicas_answer_as_one_process_and_route_by_prefix(cluster, single):
    url, client = cluster
    served = []
    for i, q in enumerate(QUESTIONS):
        r = _complete(client, SYSTEM + q, max_tokens=8)
        assert r.choices[0].token_ids == _complete(single.client, SYSTEM + q, max_tokens=8).choices[0].token_ids
        served.append(r.system_fingerprint)
        if i:  # the prompt's shared pages are cached where the first one went
            assert r.usage.prompt_tokens_details.cached_tokens >= len(SYSTEM.encode()) // 16 * 16
    assert len(set(served)) == 1 and served[0].startswith("tinyloop-")  # one replica, named
    # each replica's engine reports itself at the ingress (polled each second), the one that
    # served with its own hits
    name = served[0].removeprefix("tinyloop-")
    m = _until(lambda: (m := _metrics(url)) and sum(k.startswith("tinyloop_replica_queue_depth{") for k in m) == 2
               and m[f'tinyloop_replica_prefix_hit_rate{{replica="{name}"}}'] > 0 and m)
    assert m[f'tinyloop_replica_requests_total{{replica="{name}"}}'] == len(QUESTIONS)
    assert m["tinyloop_replicas_running"] == m["tinyloop_replicas_answering"] == 2
    _until(lambda: _status(f"{url}/health") == 200)  # (503 while a replica warms up)
    # logprobs and best_of, scored on a replica (the ingress holds no weights): as one process's
    kw = dict(max_tokens=6, logprobs=2, extra={"best_of": 2, "n": 1})
    r, one = _complete(client, SYSTEM + QUESTIONS[0], **kw), _complete(single.client, SYSTEM + QUESTIONS[0], **kw)
    assert r.choices[0].token_ids == one.choices[0].token_ids
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, one.choices[0].logprobs.token_logprobs,
                               atol=1e-4)


def test_each_replica_keeps_to_a_core_of_its_own(cluster):
    import os

    from ray import serve

    from tinyloop_jax.serving.ray_router import Probe

    engines = serve.get_deployment_handle("engines", "default")
    cores = {tuple(engines.stats.remote(Probe(i)).result(timeout_s=30)["cores"]) for i in range(2)}
    expected = [[c] for c in sorted(os.sched_getaffinity(0))[:2]]
    assert sorted(map(list, cores)) == (expected if len(expected) == 2 else expected * 2)


def test_a_killed_replica_fails_its_request_with_503_then_the_deployment_serves_again(cluster, single):
    from ray import serve

    from tinyloop_jax.serving.ray_router import Probe

    url, client = cluster
    prompt = SYSTEM + "Explain itertools."
    engines = serve.get_deployment_handle("engines", "default")

    def whole_deployment():
        m = _metrics(url)
        return m.get("tinyloop_replicas_running") == m.get("tinyloop_replicas_answering") == 2

    def running_on():  # the replica whose engine runs a request, asked of each replica now (the
        # ingress's counters are a poll of a second ago: the request may be done by then)
        for i in range(2):
            s = engines.stats.remote(Probe(i)).result(timeout_s=10)
            if s["running"] >= 1:
                return s["replica"]
        return None

    # The long request runs a few hundred milliseconds; a round whose request ends before it is
    # seen running (or before the kill lands) is tried again.
    for _ in range(3):
        _until(whole_deployment)
        _complete(client, prompt, max_tokens=4)  # (its pages now on one replica: the next goes there)
        outcome = {}

        def long_request():
            try:
                outcome["answer"] = _complete(client, prompt, max_tokens=256 - len(prompt) - 1,
                                              extra=dict(loops=MAX_LOOPS))
            except openai.APIStatusError as e:
                outcome["status"] = e.status_code, str(e)

        t = threading.Thread(target=long_request)
        t.start()
        try:
            victim = _until(lambda: "answer" in outcome or running_on(), timeout=30, every=0.01)
        except AssertionError:
            t.join(timeout=120)
            continue
        if victim is True:  # (done before it was seen)
            t.join(timeout=120)
            continue
        actor = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if victim in a["name"])
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=False)
        t.join(timeout=120)
        if "status" in outcome:
            break
    assert "answer" not in outcome and outcome["status"][0] == 503, outcome
    assert "replica" in outcome["status"][1]
    # the other replica serves on, and Ray brings the killed one back (a new name, an empty cache)

    def answered():
        try:
            return _complete(client, prompt, max_tokens=8)
        except openai.APIStatusError as e:
            assert e.status_code == 503, e  # (a request routed to the dead replica before Ray told the router)
            return None

    r = _until(answered)
    assert r.choices[0].token_ids == _complete(single.client, prompt, max_tokens=8).choices[0].token_ids

    def live():  # the replicas answering the ingress's poll
        return {k for k in _metrics(url) if k.startswith("tinyloop_replica_queue_depth{") and victim not in k}

    assert len(_until(lambda: len(live()) == 2 and live())) == 2


def test_a_replica_whose_engine_no_longer_serves_fails_rays_health_check():
    """`Engines.check_health` (Ray calls it every HEALTH_PERIOD_S and replaces a replica that
    raises): quiet while the engine serves, a RuntimeError naming the replica once its loop has
    stopped."""
    from types import SimpleNamespace

    from tinyloop_jax.serving.ray_app import Engines

    r = Engines.__new__(Engines)  # (its fields alone: no Ray replica context here)
    r.engine = tl.Engine(tiny_model("fp32"), max_batch=1)
    r.replica = SimpleNamespace(name="r0")
    r.check_health()
    r.engine.close()
    with pytest.raises(RuntimeError, match="r0: the engine's loop has stopped"):
        r.check_health()
