"""The error table of SPEC §4: each bad input raises the named error and changes nothing."""

import json

import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import functional as F
from tinyloop_jax.api import validation as check
from tinyloop_jax.api.evaluate import bits_per_byte
from tinyloop_jax.model import cache as kvc
from conftest import prompt_of, tiny_config

BAD_PROMPTS = [
    ([], "empty"),
    (np.zeros((2, 3), np.int32), "1-D"),
    (np.array([1.0, 2.0]), "integer dtype"),
    (np.array([True, False]), "integer dtype"),
    ([1, -1, 2], "-1"),
    ([1, 128], "128"),
    ("hello", "token ids"),
]

BAD_KWARGS = [
    (dict(loops=0), "loops"),
    (dict(cache_window=-1), "cache_window"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10**12), "max_tokens must be in .*1000000000000"),  # not an int32 overflow
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop_sequences=[[]]), "stop_sequences"),
    (dict(stop_sequences=[1, 2]), "stop_sequences"),
    (dict(stop_sequences=[[1, 999]]), "stop_sequences"),
    (dict(stop_sequences="ab"), "stop_sequences"),
]


@pytest.mark.parametrize("prompt,msg", BAD_PROMPTS)
def test_bad_prompt_is_value_error(models, prompt, msg):
    model = models["fp32"]
    for call in (lambda: model.generate(prompt), lambda: model.next_token_logits(prompt),
                 lambda: model.build_prefix_cache(prompt)):
        with pytest.raises(ValueError, match=msg):
            call()


@pytest.mark.parametrize("kwargs,msg", BAD_KWARGS)
def test_bad_argument_is_value_error(models, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        models["fp32"].generate([1, 2, 3], **kwargs)


def test_too_long_is_runtime_error(models):
    model = models["fp32"]  # max_seq_len 128
    with pytest.raises(RuntimeError, match="max_seq_len"):
        model.generate(prompt_of(100), max_tokens=29)
    with pytest.raises(RuntimeError, match="max_seq_len"):
        model.next_token_logits(prompt_of(129))
    assert len(model.generate(prompt_of(100), max_tokens=28)) == 128  # the boundary itself is fine


def test_out_of_memory_is_runtime_error(models, monkeypatch):
    with pytest.raises(RuntimeError, match="out of memory"):
        kvc.empty("fp32", 0, 100, 64, 2**34, 128)  # ~56 TB: refused before allocating
    monkeypatch.setattr(kvc, "free_bytes", lambda: 1000)
    with pytest.raises(RuntimeError, match="out of memory"):
        models["fp32"].generate([1, 2, 3])


def test_closed_model_raises_runtime_error():
    model = tl.Model.random(tiny_config(), seed=0)
    prefix = model.build_prefix_cache([1, 2, 3])
    model.close()
    calls = [lambda: model.generate([1, 2]), lambda: model.next_token_logits([1]),
             lambda: model.build_prefix_cache([1]), lambda: model.generate_from_prefix_cache(prefix),
             lambda: model.next_token_logits_from_prefix(prefix, [1]), model.config,
             lambda: model.weights, lambda: model.save("/tmp/never"), lambda: model.cache_nbytes(8)]
    for call in calls:
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_bad_config_and_mode():
    with pytest.raises(ValueError, match="kv_mode"):
        tiny_config(kv_mode="bf8")
    with pytest.raises(ValueError, match="divisible"):
        tiny_config(d_model=30)
    with pytest.raises(ValueError, match="default_loops"):
        tiny_config(default_loops=0)


def test_unknown_config_field_is_refused(models, tmp_path):
    """A description with a field this version does not know (a newer checkpoint) must not load
    as a different model; the descriptions this version writes load unchanged."""
    assert tl.ModelConfig.from_dict(tiny_config().to_dict()) == tiny_config()
    with pytest.raises(ValueError, match="sliding_window"):
        tl.ModelConfig.from_dict({**tiny_config().to_dict(), "sliding_window": 64})
    models["fp32"].save(tmp_path / "m")
    meta_file = tmp_path / "m" / "tinyloop.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["sliding_window"] = 64
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="sliding_window"):
        tl.Model.load(tmp_path / "m")


def test_learned_positions_past_max_seq_len_are_refused(models):
    """GPT-2 blocks have a table of max_seq_len positions: a token past it is a RuntimeError at
    every entry of the functional pipeline (and of evaluation), never a clamped position."""
    w = models["fp32"].weights  # max_seq_len 128
    p = prompt_of(129)
    for call in (lambda: F.prefill(w, p, F.empty_cache(w, 129)), lambda: F.build_prefix(w, p),
                 lambda: F.prefill_prefix_cache(p, w),
                 lambda: F.next_token_logits_with_prefix(F.prefill_prefix_cache(p[:120], w), 120, p[120:], w),
                 lambda: bits_per_byte(w.params, w.config, p, loops=1, seq_len=129)):
        with pytest.raises(RuntimeError, match="max_seq_len=128"):
            call()
    _, cache = F.prefill(w, p[:128], F.empty_cache(w, 129))  # the last position itself is fine
    with pytest.raises(RuntimeError, match="max_seq_len=128"):
        F.decode_step(w, 1, cache)
    prefix = F.build_prefix(w, p[:100])
    F.decode(w, prefix, [p[100:120]], tl.Knobs.make(1, max_tokens=9))  # feeds positions up to 127
    with pytest.raises(RuntimeError, match="max_seq_len=128"):
        F.decode(w, prefix, [p[100:120]], tl.Knobs.make(1, max_tokens=10))


def test_sampling_arguments_are_one_checked_value(models):
    """The sampling keywords become one SamplingParams, checked at the edge with messages naming
    the value; a bad one leaves a PrefixStore untouched."""
    p = check.sampling_params(128, max_tokens=8, temperature=0.5, stop_sequences=[[1, 2], np.array([3])], seed=7)
    assert p == tl.SamplingParams(max_tokens=8, temperature=0.5, seed=7, stop_sequences=((1, 2), (3,)))
    with pytest.raises(ValueError, match="temp"):
        check.sampling_params(128, temp=0.5)
    with pytest.raises(ValueError, match="seeds"):
        check.batch_sampling_params(128, 2, seed=1)
    with pytest.raises(ValueError, match=r"seeds must be a list with one seed per request \(2\)"):
        check.batch_sampling_params(128, 2, seeds=[1])
    store = tl.PrefixStore(models["fp32"])
    for kwargs, msg in BAD_KWARGS[2:]:  # the sampling ones
        with pytest.raises(ValueError, match=msg):
            store.generate([1, 2, 3], **kwargs)
    assert store.stats()["misses"] == 0 and store.stats()["entries"] == 0
