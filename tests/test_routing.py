"""The replica router's policies as plain data (`serving/routing.py`, issue 61): fake replicas
with preset loads, the chosen replica checked against what each policy promises."""

import collections

import numpy as np
import pytest

from tinyloop_jax.serving.routing import ORACLE_PAGES, Router, page_chain

P = 16
rng = np.random.default_rng(0)
SYSTEMS = [list(rng.integers(0, 1000, 150)) for _ in range(3)]  # 9 full pages each (more than ORACLE_PAGES)
S = 150 // P


def prompt(system: int, question: int) -> list:
    return SYSTEMS[system] + list(np.random.default_rng(100 + question).integers(0, 1000, 40))


def test_page_chains_share_exactly_the_full_pages_two_prompts_share():
    a, b = page_chain(prompt(0, 1)), page_chain(prompt(0, 2))
    assert len(a) == (150 + 40) // P and a[:S] == b[:S] and a[S] != b[S]
    assert page_chain(SYSTEMS[0][:P - 1]) == [] and page_chain(SYSTEMS[1])[0] != a[0]
    # a page's hash depends on every page before it (chained), not on the page alone
    assert page_chain([5] * P + [7] * P)[1] != page_chain([6] * P + [7] * P)[1]


def test_prefix_routing_follows_the_longest_match_within_the_load_bound():
    r = Router("prefix", imbalance=2)
    loads = {"a": 0, "b": 0, "c": 0}
    first = r.rank(page_chain(prompt(0, 1)), loads)[0]  # nothing cached: the least loaded
    r.routed(first, page_chain(prompt(0, 1)))
    loads[first] = 2  # busier, within the bound: the match still wins
    assert r.rank(page_chain(prompt(0, 2)), loads)[0] == first
    assert r.match(first, page_chain(prompt(0, 2))) == S
    other = r.rank(page_chain(prompt(1, 1)), loads)[0]  # no match: the least loaded
    assert other != first and loads[other] == 0
    loads[first] = 3  # past least + imbalance: the prefix spreads to the least loaded
    ranked = r.rank(page_chain(prompt(0, 3)), loads)
    assert ranked[0] != first and ranked[-1] == first


def test_each_replica_keeps_the_pages_its_pool_holds_most_recent_first():
    """Capacity 10 pages: a prompt of 11 loses its last page first (as the engine's index drops
    leaves first); a second prompt evicts the first one's pages."""
    r = Router("prefix", capacity_pages=10)
    r.routed("a", page_chain(prompt(0, 1)))
    assert r.match("a", page_chain(prompt(0, 1))) == 10 and r.match("a", page_chain(prompt(0, 2))) == S
    r.routed("a", page_chain(prompt(1, 1)))
    assert r.match("a", page_chain(prompt(0, 2))) == 0 and r.match("a", page_chain(prompt(1, 2))) == S
    r.forget("a")
    assert r.match("a", page_chain(prompt(1, 2))) == 0


def test_round_robin_power_of_two_and_the_oracle():
    loads = {"a": 5, "b": 1, "c": 3}
    rr = Router("round_robin")
    assert collections.Counter(rr.rank([], loads)[0] for _ in range(9)) == {"a": 3, "b": 3, "c": 3}
    p2 = Router("power_of_two", seed=1)
    for _ in range(20):
        top, second = p2.rank([], loads)[:2]
        assert loads[top] <= loads[second]
    oracle = Router("oracle")
    picks = {s: {oracle.rank(page_chain(prompt(s, q)), dict(loads, **{k: q for k in loads}))[0] for q in range(6)}
             for s in range(3)}
    assert all(len(p) == 1 for p in picks.values())  # one replica a system prompt, whatever the load
    assert S >= ORACLE_PAGES  # (keyed by the first ORACLE_PAGES pages: inside the system prompt)
    # a replica leaving moves only the prompts it held
    gone = next(iter(picks[0]))
    after = {s: oracle.rank(page_chain(prompt(s, 0)), {k: 0 for k in loads if k != gone})[0] for s in range(3)}
    assert all(after[s] == next(iter(picks[s])) for s in range(3) if next(iter(picks[s])) != gone)


def test_bad_router_settings_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="'fastest'"):
        Router("fastest")
    with pytest.raises(ValueError, match="capacity_pages"):
        Router(capacity_pages=0)
    with pytest.raises(ValueError, match="no replica"):
        Router().rank([], {})


def test_the_ray_request_router_ranks_by_the_request_value_in_positional_args():
    """`TinyloopRouter` Ray's way (no cluster: fake replicas, preset queue lengths in Ray's
    cache): a long match picks its replica, no match the least loaded, overload falls back, a
    body in kwargs alone routes by load, a dead replica is forgotten."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from tinyloop_jax.api.request import Request
    from tinyloop_jax.serving.ray_router import Probe, TinyloopRouter

    dep = DeploymentID(name="engine", app_name="tinyloop")
    router = TinyloopRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(policy="prefix", imbalance=2)
    fakes = [SimpleNamespace(replica_id=ReplicaID(f"r{i}", dep)) for i in range(3)]
    r0, r1, r2 = (f.replica_id for f in fakes)

    def loads(*ns):
        for f, n in zip(fakes, ns):
            router.replica_queue_len_cache.update(f.replica_id, n)

    async def route(args, kwargs=None):
        pending = PendingRequest(args=args, kwargs=kwargs or {}, metadata=RequestMetadata("id", "iid"))
        ranks = await router.choose_replicas(fakes, pending)
        if not any(isinstance(a, Probe) for a in args):  # (a probe: its one replica)
            assert sorted(str(r[0].replica_id) for r in ranks) == sorted(str(f.replica_id) for f in fakes)
        router.on_request_routed(pending, ranks[0][0].replica_id, None)
        return ranks[0][0].replica_id

    def ask(system: int, question: int):
        return asyncio.run(route([Request(np.asarray(prompt(system, question), np.int32))]))

    loads(0, 1, 5)
    assert ask(0, 1) == r0  # nothing cached: the least loaded
    loads(2, 1, 5)
    assert ask(0, 2) == r0  # its prefix, within the load bound
    assert ask(1, 1) == r1  # no match: the least loaded
    loads(4, 1, 0)
    assert ask(0, 3) == r2  # r0 past least + 2: the least loaded instead
    loads(0, 3, 3)
    assert asyncio.run(route([], {"body": {"messages": []}})) == r0  # no request value: by load, no hang
    # a probe names a replica outright (in id order), whatever the load; it records no pages
    assert [asyncio.run(route([Probe(i)])) for i in range(4)] == [r0, r1, r2, r0]
    router.on_replica_actor_died(r0)
    assert router.router.match(r0, page_chain(prompt(0, 4))) == 0


def test_replica_cores_give_each_replica_its_own_run_of_cores():
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from tinyloop_jax.serving.ray_app import replica_cores

    assert [replica_cores(r, 1, [0, 1]) for r in range(3)] == [[0], [1], [0]]  # (a third shares)
    assert [replica_cores(r, 2, [0, 1, 2, 3, 4, 5]) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert replica_cores(1, 2, [4, 7, 9]) == [4, 9]  # (the cores the process may use, wrapping)
    assert replica_cores(0, 4, [0, 1]) == [0, 1]
    with pytest.raises(ValueError, match="a core a replica"):
        replica_cores(0, 0, [0, 1])
