"""OpenAI's presence_penalty, frequency_penalty and logit_bias: applied on the device in the same
program for every value, equal to a numpy reference of OpenAI's formula
(logits - count * frequency - (count > 0) * presence, over the tokens emitted so far), the same
in every decode path (generate, batches, prefix caches, speculative, the serving engine), and
checked at the edge with messages that name the value."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import prompt_of, tiny_model

import tinyloop_jax as tl
from tinyloop_jax.api import validation as check
from tinyloop_jax.decoding.sampling import MAX_LOGIT_BIAS, adjusted_logits, distribution, filtered_logits, select_tokens


@pytest.fixture(scope="module")
def model():
    return tiny_model("fp32")


def openai_logits(logits, seen, counts, rep, presence, frequency, bias):
    """The reference, one row in numpy: logit bias, HF repetition penalty over seen, then OpenAI's
    penalties over the output counts."""
    x = np.array(logits, np.float64)
    for t, b in bias.items():
        x[t] += b
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    return x - counts * frequency - (counts > 0) * presence


def test_adjusted_logits_and_the_sampling_distribution_equal_the_reference():
    rng = np.random.default_rng(0)
    V, N = 64, 3
    logits = rng.normal(0, 2, (N, V)).astype(np.float32)
    seen = rng.random((N, V)) < 0.2
    counts = rng.integers(0, 4, (N, V)) * (rng.random((N, V)) < 0.3)
    rows = [dict(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.0,
                 logit_bias={3: 5.0, 10: -100.0}, temperature=0.8),
            dict(presence_penalty=-1.5, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={}, temperature=1.0),
            dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={7: 100.0},
                 temperature=0.0)]
    params = [tl.SamplingParams(top_k=0, logit_bias=tuple(sorted(r["logit_bias"].items())),
                                **{k: v for k, v in r.items() if k != "logit_bias"}) for r in rows]
    req = tl.Knobs.from_params(params)
    assert req.bias_ids.shape == (N, MAX_LOGIT_BIAS)  # one shape whatever the biases: one program
    got = np.asarray(adjusted_logits(jnp.asarray(logits), jnp.asarray(seen), req, jnp.asarray(counts, jnp.int32)))
    dist = np.asarray(distribution(jnp.asarray(logits), jnp.asarray(seen), req, jnp.asarray(counts, jnp.int32)))
    for i, r in enumerate(rows):
        want = openai_logits(logits[i], seen[i], counts[i], r["repetition_penalty"], r["presence_penalty"],
                             r["frequency_penalty"], r["logit_bias"])
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-5)
        if r["temperature"] > 0:  # the softmax of the adjusted logits over the temperature
            p = np.exp((want - want.max()) / r["temperature"])
            np.testing.assert_allclose(dist[i], p / p.sum(), rtol=1e-5, atol=1e-7)
        else:
            assert dist[i].argmax() == want.argmax() == 7  # +100 forces a token
    tok = np.asarray(select_tokens(jnp.asarray(logits), jnp.asarray(seen), req, jnp.int32(0),
                                   jnp.asarray(counts, jnp.int32)))
    assert tok[2] == 7 and tok[0] != 10  # -100 forbids one



def test_a_batch_without_logit_bias_carries_none_and_gets_the_same_logits():
    """No request with a logit bias: the request rows carry none (its programs leave the
    scatter out); carried empty (the serving engine's rows), the logits are the same."""
    rng = np.random.default_rng(1)
    logits, seen = jnp.asarray(rng.normal(0, 2, (2, 64)), jnp.float32), jnp.asarray(rng.random((2, 64)) < 0.2)
    params = [tl.SamplingParams(repetition_penalty=1.3), tl.SamplingParams()]
    plain, carried = tl.Knobs.from_params(params), tl.Knobs.from_params(params, logit_bias=True)
    assert plain.bias_ids is None and carried.bias_ids.shape == (2, MAX_LOGIT_BIAS)
    assert tl.Knobs.make(2, logit_bias={3: 1.0}).bias_ids.shape == (2, MAX_LOGIT_BIAS)
    np.testing.assert_array_equal(adjusted_logits(logits, seen, plain), adjusted_logits(logits, seen, carried))


def test_a_greedy_batch_compiles_no_sampling_and_chooses_the_same_tokens(model):
    """Every request greedy: the request is marked unsampled, and its programs hold no sort and no
    random draw; marked sampled (the serving engine's rows), the tokens are the same. One row
    with a temperature marks the batch sampled."""
    import jax
    rng = np.random.default_rng(2)
    logits, seen = jnp.asarray(rng.normal(0, 2, (2, 64)), jnp.float32), jnp.asarray(rng.random((2, 64)) < 0.2)
    params = [tl.SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), tl.SamplingParams()]
    greedy, marked = tl.Knobs.from_params(params), tl.Knobs.from_params(params, sampled=True)
    assert not greedy.sampled and marked.sampled
    assert tl.Knobs.from_params([params[0], tl.SamplingParams(temperature=0.7)]).sampled
    counts = jnp.asarray(rng.integers(0, 3, (2, 64)), jnp.int32)
    pick = lambda req: select_tokens(logits, seen, req, jnp.int32(3), counts)  # noqa: E731
    np.testing.assert_array_equal(pick(greedy), pick(marked))
    np.testing.assert_array_equal(pick(greedy), np.argmax(adjusted_logits(logits, seen, greedy, counts), -1))
    prims = lambda req: str(jax.make_jaxpr(pick)(req))  # noqa: E731
    draws = ("threefry", "random_bits")  # (a hash of chosen counters; a row's noise by jax.random)
    assert "sort" not in prims(greedy) and not any(d in prims(greedy) for d in draws)
    assert "sort" in prims(marked) and any(d in prims(marked) for d in draws)
    prompt = prompt_of(12, seed=4)
    assert model.generate(prompt, max_tokens=6) == model.generate(prompt, max_tokens=6, temperature=0.5, top_k=1)


def reference_filter(logits, temperature, top_k, top_p):
    """numpy: sort by logit (stable, ties in id order), keep the top-k ranks and the nucleus,
    put the kept values back by id, -inf elsewhere."""
    scaled = np.float32(logits) / np.float32(temperature)
    order = np.argsort(-scaled, kind="stable")
    s = scaled[order]
    rank = np.arange(len(s))
    keep = (top_k <= 0) | (rank < top_k)
    e = np.where(keep, np.exp(np.float64(s - s.max())), 0.0)
    p = e / e.sum()
    keep &= (np.cumsum(p) - p < top_p) | (rank == 0)
    out = np.full_like(scaled, -np.inf)
    out[order[keep]] = s[keep]
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (7, 0.8), (1, 1.0), (3, 0.05)])
def test_top_k_and_top_p_keep_the_reference_set_with_ties(top_k, top_p):
    """The filtered logits equal the numpy sort-filter-scatter reference, logits with ties
    included (equal logits kept lowest id first)."""
    rng = np.random.default_rng(top_k)
    for row in range(4):
        logits = np.round(rng.normal(0, 1.5, 96), 1).astype(np.float32)  # many equal values
        got = np.asarray(filtered_logits(jnp.asarray(logits)[None], jnp.float32([0.7]), jnp.int32([top_k]),
                                         jnp.float32([top_p])))[0]
        want = reference_filter(logits, 0.7, top_k, top_p)
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
        np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)

def reference_greedy(model, prompt, n, presence=0.0, frequency=0.0, bias=None):
    """Greedy decoding with OpenAI's penalties applied in numpy to the model's next-token logits."""
    seq, counts = list(prompt), np.zeros(model.config()["vocab_size"])
    for _ in range(n):
        x = openai_logits(model.next_token_logits(seq), np.zeros_like(counts, bool), counts, 1.0, presence, frequency,
                          bias or {})
        t = int(np.argmax(x))
        seq.append(t)
        counts[t] += 1
    return seq


def test_generate_with_penalties_equals_the_reference(model):
    prompt = prompt_of(10, seed=1)
    plain = model.generate(prompt, max_tokens=12)
    assert len(set(plain[10:])) < 12  # the tiny model repeats itself: the penalties have work to do
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(frequency_penalty=-2.0),
               dict(presence_penalty=1.0, frequency_penalty=0.5, logit_bias={5: 3.0})):
        got = model.generate(prompt, max_tokens=12, **{k: v for k, v in kw.items()})
        want = reference_greedy(model, prompt, 12, kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0),
                                kw.get("logit_bias"))
        assert got == want, kw
    assert model.generate(prompt, max_tokens=12, presence_penalty=2.0) != plain


def test_logit_bias_forces_and_forbids_tokens(model):
    prompt = prompt_of(10, seed=2)
    plain = model.generate(prompt, max_tokens=8)[10:]
    assert model.generate(prompt, max_tokens=8, logit_bias={42: 100})[10:] == [42] * 8
    forbidden = set(plain)
    out = model.generate(prompt, max_tokens=8, logit_bias={t: -100 for t in forbidden})[10:]
    assert not forbidden & set(out)
    sampled = model.generate(prompt, max_tokens=8, temperature=1.5, top_k=0, seed=3, logit_bias={42: 100})[10:]
    assert sampled == [42] * 8  # sampling too: +100 leaves no mass elsewhere


def test_every_decode_path_applies_them_alike(model):
    """Batches, prefix caches, speculative decoding and the serving engine: the same tokens as
    `generate` with the same knobs (greedy, and a seeded sample)."""
    prompt = prompt_of(24, seed=4)
    knobs = [dict(presence_penalty=1.5, frequency_penalty=0.7, logit_bias={9: 4.0, 11: -100}),
             dict(temperature=0.9, top_k=20, seed=5, frequency_penalty=1.2, logit_bias={20: 2.5})]
    prefix = model.build_prefix_cache(prompt[:16])
    store = tl.PrefixStore(model)
    with tl.Engine(model, max_batch=4, prefill_chunk=16) as eng:
        for kw in knobs:
            want = model.generate(prompt, max_tokens=10, **kw)
            assert model.generate_batch([prompt, prompt[:20]], max_tokens=10, seeds=[kw.get("seed", 0)] * 2,
                                        **{k: v for k, v in kw.items() if k != "seed"})[0] == want
            assert model.generate_from_prefix_cache(prefix, suffix=prompt[16:], max_tokens=10, **kw) == want
            assert store.generate(prompt, max_tokens=10, **kw) == want
            assert eng.submit(prompt, max_tokens=10, **kw).result() == want
            if "temperature" not in kw:  # greedy speculative output is plain greedy output
                assert model.generate(prompt, max_tokens=10, draft_loops=1, **kw) == want


@pytest.mark.parametrize("kwargs,msg", [
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\], got -3"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias\\[5\\] must be in \\[-100, 100\\], got 101"),
    (dict(logit_bias={128: 1}), "token id 128"),
    (dict(logit_bias={"x": 1}), "logit_bias token id"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "301 entries"),
])
def test_bad_penalties_are_value_errors(model, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        model.generate([1, 2, 3], **kwargs)


def test_json_style_logit_bias_keys(model):
    """JSON object keys are strings: {"42": 100} is token 42."""
    p = check.sampling_params(128, logit_bias={"42": 100, 7: -5.5})
    assert p.logit_bias == ((7, -5.5), (42, 100.0))
    assert model.generate([1, 2], max_tokens=3, logit_bias={"42": 100})[2:] == [42] * 3


def test_one_program_for_every_value(model):
    """Different penalties and biases reuse the compiled decode program: a batch with a logit
    bias compiles its variant once (a batch without one leaves the bias step out), then every
    bias value and penalty runs one of the two."""
    from tinyloop_jax.decoding.compiled import SHARED

    prompt = prompt_of(8, seed=6)
    model.generate(prompt, max_tokens=5, presence_penalty=0.5)
    first = SHARED.decode_steps._cache_size()
    model.generate(prompt, max_tokens=5, logit_bias={5: 1.0})
    before = SHARED.decode_steps._cache_size()
    assert before <= first + 1
    for kw in (dict(frequency_penalty=1.0), dict(logit_bias={1: 2.0, 2: -3.0, 3: 4.0}), dict(),
               dict(repetition_penalty=1.2, logit_bias={7: -1.0})):
        model.generate(prompt, max_tokens=5, **kw)
    assert SHARED.decode_steps._cache_size() == before
