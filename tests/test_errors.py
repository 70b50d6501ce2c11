"""The error table of SPEC §4: each bad input raises the named error and changes nothing."""

import numpy as np
import pytest

import tinyloop_jax as tl
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
