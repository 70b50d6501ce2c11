"""The replica router on Ray Serve's `RequestRouter` API (issue 61; the `ray` extra): set as the
engine deployment's `request_router_config`, never the HTTP-facing one's (a request body in
kwargs makes Ray's own prefix router hang every request, ray#64326).

It ranks the candidate replicas with `routing.Router` (the policy's choice) from the request
value in the pending request's positional arguments — an object with a `prompt` of token ids
(the chat template already rendered, `api.request.Request`) — and Ray's cached queue lengths;
after a request is routed it records the prompt's pages as that replica's; a replica that dies
is forgotten. A `Probe(i)` argument instead names the i-th replica (in id order) outright.

    RequestRouterConfig(request_router_class="tinyloop_jax.serving.ray_router:TinyloopRouter",
                        request_router_kwargs={"policy": "prefix", "capacity_pages": 4096})
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import Router, page_chain


@dataclass(frozen=True)
class Probe:
    """A call for one replica in particular: the `index`-th of the candidates in id order (the
    ingress asks each replica for its engine's counters this way; Ray Serve has no broadcast)."""

    index: int


def probe_of(pending: PendingRequest | None) -> Probe | None:
    return next((a for a in (() if pending is None else pending.args) if isinstance(a, Probe)), None)


def prompt_of(pending: PendingRequest | None):
    """The token ids of the request value among the positional arguments (None: none)."""
    for arg in () if pending is None else pending.args:
        prompt = getattr(arg, "prompt", None)
        if prompt is not None and not isinstance(prompt, str):
            return prompt
    return None


class TinyloopRouter(RequestRouter):
    """`routing.Router`'s ranking as a Ray Serve request router (one replica a rank)."""

    def initialize_state(self, policy: str = "prefix", capacity_pages: int = 4096, imbalance: int = 4,
                         seed: int = 0, **_) -> None:
        self.router = Router(policy, capacity_pages, imbalance, seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # a retry (every ranked replica full or slow to say) sleeps first:
            # without this Ray retries at once, and the spinning router thread starves the process's
            # other threads (its queue-length probes time out, so it spins on: seen as a hung request)
            pending_request.routing_context.should_backoff = True
        probe = probe_of(pending_request)
        if probe is not None:
            ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
            return [[ordered[probe.index % len(ordered)]]]
        prompt = prompt_of(pending_request)
        chain = [] if prompt is None else page_chain(prompt)
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {i: self.replica_queue_len_cache.get(i) or 0 for i in by_id}
        return [[by_id[i]] for i in self.router.rank(chain, loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        prompt = prompt_of(pending_request)
        if prompt is not None:
            self.router.routed(replica_id, page_chain(prompt))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.forget(replica_id)
