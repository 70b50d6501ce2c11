"""One request value (`api.request`): the DepthPlan sum type from the flat keywords, the one
check against a model, and a Request taken whole by `generate`."""

import numpy as np
import pytest

import tinyloop_jax as tl
from tinyloop_jax.api import request as R
from conftest import ouro_model, prompt_of, tiny_config, tiny_model


def test_flat_keywords_name_one_kind_of_plan():
    assert R.DepthPlan.of() == tl.Fixed()
    assert R.DepthPlan.of(loops=3, exit_at_step=1) == tl.Fixed(loops=3, exit_at_step=1)
    assert R.DepthPlan.of(draft_loops=1, lookahead=2) == tl.Speculative(draft_loops=1, lookahead=2)
    ada = R.DepthPlan.of(loops=4, exit_criterion="kl", exit_threshold=0.01, exit_in_prefill=True)
    assert ada == tl.Adaptive(loops=4, criterion="kl", threshold=0.01, in_prefill=True)
    for plan in (tl.Fixed(loops=2, exit_at_step=0), tl.Speculative(loops=3, draft_loops=2), ada):
        assert R.DepthPlan.of(**R.flat(plan)) == plan
    for kw, match in ((dict(exit_criterion="kl", draft_loops=1), "draft_loops .* does not go with exit_criterion"),
                      (dict(exit_criterion="kl", exit_at_step=1), "do not go with exit_criterion"),
                      (dict(exit_in_prefill=True), "exit_in_prefill needs an exit_criterion"),
                      (dict(min_steps=2), "min_steps need an exit_criterion")):
        with pytest.raises(ValueError, match=match):
            R.DepthPlan.of(**kw)


def test_checked_resolves_once_and_refuses_bad_values():
    cfg = tiny_config(kv_mode="fp32")
    req = R.checked(tl.Request([1, 2, 3], tl.SamplingParams(max_tokens=4), tl.Adaptive(criterion="latent-diff")), cfg)
    assert req.loops == cfg.default_loops and req.prompt.dtype == np.int32
    assert req.policy is not None and float(req.policy.threshold) == pytest.approx(0.03)  # the criterion's default
    assert R.checked(req, cfg) is req  # checked once
    later = R.with_deadline(req, 5.0)
    assert later.deadline == 5.0 and R.checked(later, cfg) is later
    assert R.checked(tl.Request([1]), cfg).policy is None
    for bad, match in ((tl.Request([1, 200]), r"prompt\[1\] = 200"),
                       (tl.Request([1], tl.SamplingParams(top_p=0.0)), "top_p"),
                       (tl.Request([1], plan=tl.Speculative(loops=2, draft_loops=3)), "draft_loops=3"),
                       (tl.Request([1], plan=tl.Adaptive(criterion="nope")), "unknown exit_criterion"),
                       (tl.Request([1], plan=tl.Fixed(exit_at_step=1)), "early-exit gate"),
                       (tl.Request([1], plan=tl.DepthPlan(loops=2)), "a Fixed, Speculative or Adaptive"),
                       (tl.Request([1], cache_window=-1), "cache_window")):
        with pytest.raises(ValueError, match=match):
            R.checked(bad, cfg)
    with pytest.raises(ValueError, match="exit_at_step=5 is not a pass"):
        R.checked(tl.Request([1], plan=tl.Fixed(exit_at_step=5)), ouro_model("fp32").weights.config)


def test_generate_takes_a_request_whole():
    model = tiny_model("fp32")
    p = prompt_of(10, seed=3)
    params = tl.SamplingParams(max_tokens=6, temperature=0.9, seed=4)
    assert model.generate(tl.Request(p, params, tl.Fixed(loops=2))) == \
        model.generate(p, max_tokens=6, temperature=0.9, seed=4, loops=2)
    with pytest.raises(ValueError, match="inside the Request or as keywords"):
        model.generate(tl.Request(p, params), max_tokens=3)
    with pytest.raises(ValueError, match="unknown argument"):
        R.from_keywords(p, max_token=3)
