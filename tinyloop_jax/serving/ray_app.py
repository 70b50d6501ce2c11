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

import os
import threading

from ray import serve
from ray.serve.config import RequestRouterConfig

from .. import settings
from .ray_router import Probe
from .replica import EngineReplica, RemoteEngine, RemoteModel

POLL_S = 1.0  # how often the ingress asks each replica for its engine's counters
HEALTH_PERIOD_S, HEALTH_TIMEOUT_S = 10.0, 60.0  # Ray's health checks of a replica (`Engines.check_health`)


def replica_cores(rank: int, per: int, available: list[int]) -> list[int]:
    """The cores the replica of local rank `rank` keeps to: the rank-th run of `per` of the
    `available` ones, wrapping past the last (more replicas than cores share them)."""
    if per < 1 or not available:
        raise ValueError(f"need a core a replica and some cores, got {per} of {available}")
    start = rank * per
    return sorted({available[(start + i) % len(available)] for i in range(per)})


def pin(cores: list[int]) -> None:
    """Keep every thread of this process (and those it starts later) to `cores` — before JAX
    starts its thread pool, which XLA sizes by the cores the process may run on."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread gone since, or not ours to move
            pass


def load_random(config, seed: int = 0):
    """(a random model of `config`, the byte tokenizer): tests."""
    import tinyloop_jax as tl

    return tl.Model.random(config, seed=seed), tl.ByteTokenizer()


class Engines:
    """One engine a replica (the engine deployment's class)."""

    def __init__(self, load, engine_kwargs: dict, warmup: dict | None, cores: int | None = None):
        from .engine import Engine

        ctx = serve.get_replica_context()
        if cores:  # (a whole number of cores: this replica's own, by its rank on the node)
            pin(replica_cores(ctx.rank.local_rank, cores, sorted(os.sched_getaffinity(0))))
        model, tok = load()
        settings.forget_programs()  # (the load's layout programs, as `tinyloop serve`)
        self.engine = Engine(model, **engine_kwargs)
        if warmup is not None:  # (as `tinyloop serve`: in the background, each request compiling what it needs first)
            self.engine.warmup(background=True, **warmup)
        self.replica = EngineReplica(self.engine, tok, ctx.replica_id.unique_id)

    async def generate(self, request):
        async for msg in self.replica.generate(request):
            yield msg

    def describe(self, probe: Probe):
        """The served model's config (for an ingress that loads no weights)."""
        return self.engine.model.weights.config

    async def score(self, tokens: list, loops, top_logprobs: int):
        """`Model.score` here (best_of and logprobs for an ingress that loads no weights), as
        numpy; on a thread, so this replica's event loop keeps answering (its streams, Ray's
        queue-length probes) while it runs."""
        import asyncio

        import numpy as np

        s = await asyncio.to_thread(self.engine.model.score, tokens, loops=loops, top_logprobs=top_logprobs)
        return type(s)(*(np.asarray(a) for a in s))

    def check_health(self) -> None:
        """Ray Serve's health check (every HEALTH_PERIOD_S): an engine that no longer serves
        raises, and Ray replaces this replica."""
        why = self.engine.stalled()
        if why:
            raise RuntimeError(f"replica {self.replica.name}: {why}")

    def stats(self, probe: Probe) -> dict:
        """This replica's engine counters (`probe` routed the call here), its name and cores."""
        return dict(self.engine.stats(), replica=self.replica.name, warming=self.engine.warming,
                    cores=sorted(os.sched_getaffinity(0)))


class Ingress:
    """The OpenAI routes over the engine replicas (the ingress deployment's class)."""

    def __init__(self, engines, load, name: str, eos: list, max_loops: int, app_kwargs: dict, replicas: int,
                 tokenizer=None):
        self.engines = engines
        if tokenizer is None:  # the model here too (its config checks requests, best_of scores with it)
            self.model, self.tokenizer = load()
        else:  # no weights here: the config asked of a replica, best_of and logprobs scored there
            self.tokenizer = tokenizer()
            self.model = RemoteModel(lambda: engines.describe.remote(Probe(0)).result(timeout_s=10),
                                     lambda t, loops, top: engines.score.remote(t, loops, top))
        self.name, self.eos, self.max_loops, self.app_kwargs = name, list(eos), max_loops, app_kwargs
        self.replicas, self.polled, self.running = replicas, {}, 0  # polled: replica -> its engine's counters
        threading.Thread(target=self._poll, daemon=True, name="tinyloop-replica-stats").start()

    def _poll(self) -> None:
        """Each replica's engine counters and Ray's count of running replicas, every POLL_S (a
        replica that does not answer in time drops out until it does)."""
        import time

        app = serve.get_replica_context().app_name
        while True:
            if isinstance(self.model, RemoteModel):
                self.model.fetch()
            seen = {}
            for i in range(self.replicas):
                try:
                    s = self.engines.stats.remote(Probe(i)).result(timeout_s=5)
                except Exception:  # noqa: BLE001 - dying, restarting or busy past the timeout
                    continue
                seen[s.pop("replica")] = s
            self.polled = seen
            try:
                self.running = serve.status().applications[app].deployments["engines"].replica_states.get("RUNNING", 0)
            except Exception:  # noqa: BLE001 - the controller restarting: the last count stands
                pass
            time.sleep(POLL_S)

    def warming(self) -> bool:
        """Until Ray runs every replica and each one that answers has finished its warmup."""
        described = not isinstance(self.model, RemoteModel) or self.model.described
        return not described or self.running < self.replicas or any(s["warming"] for s in self.polled.values())

    def __serve_build_asgi_app__(self):
        from .app import make_app

        engines = self.engines.options(stream=True)
        remote = RemoteEngine(self.model, lambda request: engines.generate.remote(request), self.max_loops,
                              stats=lambda: self.polled, warming=self.warming, running=lambda: self.running)
        return make_app(remote, self.tokenizer, self.name, self.eos, **self.app_kwargs)


def build_app(load, replicas: int = 2, router: str = "prefix", cores_per_replica: float = 1.0,
              engine_kwargs: dict | None = None, name: str = "tinyloop", eos: list = (), max_loops: int = 16,
              router_kwargs: dict | None = None, app_kwargs: dict | None = None, warmup: dict | None = None,
              tokenizer=None):
    """The Ray Serve application (`serve.run(build_app(...))`): `replicas` engines routed by
    `router` (`routing.POLICIES`), each warming up with `warmup` (`Engine.warmup`'s keywords;
    None: none) and, where `cores_per_replica` is whole, pinned to cores of its own (`pin`),
    and the ingress. tokenizer: a picklable callable giving the tokenizer alone — the ingress
    then loads no weights (the config asked of a replica, best_of and logprobs scored there);
    None: it calls `load` too."""
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
                               request_router_config=routing, max_ongoing_requests=64,
                               health_check_period_s=HEALTH_PERIOD_S, health_check_timeout_s=HEALTH_TIMEOUT_S)
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", ray_actor_options=dict(num_cpus=0))
    cores = int(cores_per_replica) if float(cores_per_replica).is_integer() else None
    return ingress.bind(engines.bind(load, engine_kwargs, warmup, cores), load, name, list(eos), max_loops,
                        app_kwargs or {}, replicas, tokenizer)

