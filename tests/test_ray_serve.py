"""Two engine replicas on Ray Serve behind the ingress (`serving/ray_app.py`, issue 61), a local
Ray instance, through the `openai` client: answers equal `model.generate`'s, and a request that
shares a cached prompt's pages goes where they are (its cached tokens and the replica's name
reported)."""

import functools
import socket

import pytest
from conftest import tiny_config

import tinyloop_jax as tl

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
# (Ray's own pydantic fields, and its process spawns: fork + exec, which JAX's fork warning does not tell apart)
pytestmark = [pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
              pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called")]
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from tinyloop_jax.serving.ray_app import build_app, load_random

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options=dict(host="127.0.0.1", port=port))
    config = tiny_config(vocab_size=260)
    load = functools.partial(load_random, config, 3)
    serve.run(build_app(load, replicas=2, router="prefix", cores_per_replica=0.5, name="tiny",
                        eos=[tl.ByteTokenizer.EOS], max_loops=4, engine_kwargs=dict(max_batch=4)),
              route_prefix="/", blocking=False)
    yield load()[0], openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    serve.shutdown()
    ray.shutdown()


@pytest.mark.slow
def test_two_replicas_answer_as_generate_and_route_by_prefix(cluster):
    model, client = cluster
    tok = tl.ByteTokenizer()
    system = "You are terse and exact. " * 3  # 4 full pages of 16 bytes
    served = []
    for i, q in enumerate(["What is two plus two?", "Name a colour.", "Say hi."]):
        r = client.completions.create(model="tiny", prompt=system + q, max_tokens=6, temperature=0.0,
                                      extra_body=dict(ignore_eos=True))
        ids = tok.encode(system + q)
        assert r.choices[0].token_ids == model.generate(ids, max_tokens=6)[len(ids):]
        served.append(r.system_fingerprint)
        if i:  # the prompt's shared pages are cached where the first one went
            assert r.usage.prompt_tokens_details.cached_tokens >= len(tok.encode(system)) // 16 * 16
    assert len(set(served)) == 1 and served[0].startswith("tinyloop-")  # one replica, named
