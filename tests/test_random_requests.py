"""A property of the two drivers: random requests of every kind — plain, sampled, windowed,
speculative, adaptive (some exiting in prefill), n > 1 choices of one prompt — through the
`Engine` together give the tokens `generate` gives each alone."""

import itertools

import numpy as np
from conftest import prompt_of
from test_adaptive import huginn

import tinyloop_jax as tl
from tinyloop_jax.serving.protocol import choice_seed

KINDS = ("plain", "sampled", "windowed", "speculative", "adaptive", "choices")
ADAPTIVE = (dict(exit_criterion="kl", exit_threshold=1e-2), dict(exit_criterion="latent-diff", exit_threshold=0.3),
            dict(exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True),
            dict(exit_criterion="argmax-stability", exit_threshold=2, min_steps=1))


def random_work(rng, system: np.ndarray, n: int) -> tuple[list, set]:
    """n requests (prompt, keywords): the kinds in turn from a random one (every kind within
    n >= 8 requests), half of the prompts after a shared system prompt; and the kinds drawn."""
    out, kinds, first = [], set(), int(rng.integers(len(KINDS)))
    for i in itertools.count():
        if len(out) >= n:
            break
        own = prompt_of(int(rng.integers(1, 13)), seed=int(rng.integers(1 << 20)))  # (16 or 64 positions)
        prompt = np.concatenate([system, own]) if rng.random() < 0.5 else own
        kw = dict(max_tokens=int(rng.integers(1, 10)), loops=6)  # one depth: one set of programs
        kind = KINDS[(first + i) % len(KINDS)]
        kinds.add(kind)
        if kind == "sampled":
            kw.update(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 31)))
        elif kind == "windowed":
            kw.update(cache_window=int(rng.choice([8, 16])))  # (generate: a program per window)
        elif kind == "speculative":  # greedy: the same tokens (sampled: the same distribution only)
            kw.update(draft_loops=int(rng.choice([1, 3])), lookahead=3)  # (each pair is a program)
        elif kind == "adaptive":
            kw.update(ADAPTIVE[int(rng.integers(len(ADAPTIVE)))])
        if kind == "choices":  # n > 1: one prompt, each choice seeded as the server seeds it
            seed = int(rng.integers(1 << 31))
            out += [(prompt, dict(kw, temperature=0.9, seed=choice_seed(seed, j))) for j in range(3)]
        else:
            out.append((prompt, kw))
    return out[:n], kinds


def test_random_requests_through_the_engine_equal_generate():
    """A round of 10 random requests, every kind among them, through one engine."""
    m, drawn = huginn(), set()
    with tl.Engine(m, max_batch=4, prefill_chunk=16) as eng:
        for seed in range(1):
            rng = np.random.default_rng(seed)
            work, kinds = random_work(rng, prompt_of(37, seed=100 + seed), 10)
            drawn |= kinds
            handles = [eng.submit(p, **kw) for p, kw in work]
            for (p, kw), h in zip(work, handles):
                assert h.result() == m.generate(p, **kw), (seed, kw)
    assert drawn == set(KINDS)
