"""Several engines on Ray Serve (issue 61; the `ray` extra): N engine replicas behind one
ingress that serves the OpenAI routes of `tinyloop serve`.

    ingress    one deployment, no engine resources: the app of `serving/app.py` over a
               `replica.RemoteEngine` (each body parsed and checked once, the chat template
               rendered into the request value, which crosses as plain data)
    engines    N replicas, one `Engine` each (`cores_per_replica` CPUs apiece), each request's
               tokens streamed back (`replica.EngineReplica`); routed by `ray_router.TinyloopRouter`
               (`routing.Router`'s policy) on the request value in positional arguments

`load` builds (model, tokenizer) in each process that needs them (a replica; the ingress, for
the config that checks requests and for best_of's scoring): a picklable callable, e.g.
`functools.partial(cli.model_and_tokenizer_of, "smollm2")`.
"""

from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from .replica import EngineReplica, RemoteEngine


def load_random(config, seed: int = 0):
    """(a random model of `config`, the byte tokenizer): tests."""
    import tinyloop_jax as tl

    return tl.Model.random(config, seed=seed), tl.ByteTokenizer()


class Engines:
    """One engine a replica (the engine deployment's class)."""

    def __init__(self, load, engine_kwargs: dict, warmup: dict | None):
        from .engine import Engine

        model, tok = load()
        self.engine = Engine(model, **engine_kwargs)
        if warmup is not None:  # (as `tinyloop serve`: in the background, each request compiling what it needs first)
            self.engine.warmup(background=True, **warmup)
        self.replica = EngineReplica(self.engine, tok, serve.get_replica_context().replica_id.unique_id)

    async def generate(self, request):
        async for msg in self.replica.generate(request):
            yield msg

    def stats(self) -> dict:
        return self.engine.stats()


class Ingress:
    """The OpenAI routes over the engine replicas (the ingress deployment's class)."""

    def __init__(self, engines, load, name: str, eos: list, max_loops: int, app_kwargs: dict):
        self.engines, (self.model, self.tokenizer) = engines, load()
        self.name, self.eos, self.max_loops, self.app_kwargs = name, list(eos), max_loops, app_kwargs

    def __serve_build_asgi_app__(self):
        from .app import make_app

        engines = self.engines.options(stream=True)
        remote = RemoteEngine(self.model, lambda request: engines.generate.remote(request), self.max_loops)
        return make_app(remote, self.tokenizer, self.name, self.eos, **self.app_kwargs)


def build_app(load, replicas: int = 2, router: str = "prefix", cores_per_replica: float = 1.0,
              engine_kwargs: dict | None = None, name: str = "tinyloop", eos: list = (), max_loops: int = 16,
              router_kwargs: dict | None = None, app_kwargs: dict | None = None, warmup: dict | None = None):
    """The Ray Serve application (`serve.run(build_app(...))`): `replicas` engines routed by
    `router` (`routing.POLICIES`), each warming up with `warmup` (`Engine.warmup`'s keywords;
    None: none), and the ingress."""
    from .routing import POLICIES

    if router not in POLICIES:
        raise ValueError(f"router must be one of {', '.join(POLICIES)}, got {router!r}")
    if replicas < 1 or cores_per_replica <= 0:
        raise ValueError(f"replicas must be >= 1 and cores_per_replica > 0, got {replicas}, {cores_per_replica}")
    engine_kwargs = dict(engine_kwargs or {}, max_loops=max_loops)
    routing = RequestRouterConfig(request_router_class="tinyloop_jax.serving.ray_router:TinyloopRouter",
                                  request_router_kwargs=dict(router_kwargs or {}, policy=router))
    engines = serve.deployment(Engines, name="engines", num_replicas=replicas,
                               ray_actor_options=dict(num_cpus=cores_per_replica),
                               request_router_config=routing, max_ongoing_requests=64)
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", ray_actor_options=dict(num_cpus=0))
    return ingress.bind(engines.bind(load, engine_kwargs, warmup), load, name, list(eos), max_loops, app_kwargs or {})

