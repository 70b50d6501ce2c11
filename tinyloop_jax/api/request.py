"""One request as one value, and the one place its knobs are checked.

    Request(prompt, params: SamplingParams, plan: DepthPlan, cache_window, deadline)

`DepthPlan` is a sum type, each kind with only its own knobs:

    Fixed(loops, exit_at_step, early_exit_threshold)   every pass runs; the exit pick is Ouro's
                                                        choice of the pass that feeds the head
    Speculative(Fixed's, draft_loops, lookahead)        a fixed-depth run that drafts `lookahead`
                                                        tokens at depth draft_loops and verifies
    Adaptive(loops, criterion, threshold, min_steps,    a token's passes stop at its exit
             check_every, continuous_compute, in_prefill)

Two builders: `from_keywords` (the flat keywords of `Model.generate*`, `Engine.submit`,
`PrefixStore.generate`: sugar over params= / plan=) and the server's `protocol.Parsed.request`
(one per choice of an HTTP body). `checked(request, config)` validates a request against a
model once — its prompt, its sampling knobs, its plan (loops resolved, the adaptive `Policy`
built), its window — and marks it so; a checked request is not checked again.

>>> from_keywords([1, 2, 3], max_tokens=8, loops=4, draft_loops=1).plan
Speculative(loops=4, exit_at_step=None, early_exit_threshold=None, draft_loops=1, lookahead=4)
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

import numpy as np

from ..decoding.sampling import SamplingParams
from ..decoding.speculative import Speculation
from ..model import adaptive as ad
from ..model.config import ModelConfig
from . import validation as check


@dataclasses.dataclass(frozen=True, kw_only=True)
class DepthPlan:
    """How deep a request runs: `loops` passes (None: the model's default). A sum type: build
    one of `Fixed`, `Speculative`, `Adaptive`, or `DepthPlan.of(**flat_keywords)`."""

    loops: int | None = None

    @staticmethod
    def of(loops=None, exit_at_step=None, early_exit_threshold=None, exit_criterion=None, exit_threshold=None,
           min_steps=0, check_every=1, continuous_compute=False, exit_in_prefill=False, draft_loops=None,
           lookahead=4) -> "DepthPlan":
        """The plan that `generate`'s flat keywords name, refusing the knobs of two kinds at once
        with a message naming them."""
        if exit_criterion is None:
            if exit_in_prefill is not False:
                raise ValueError("exit_in_prefill needs an exit_criterion")
            loose = [k for k, v in dict(exit_threshold=exit_threshold, min_steps=min_steps, check_every=check_every,
                                        continuous_compute=continuous_compute).items() if v != _PLAN_DEFAULTS[k]]
            if loose:
                raise ValueError(f"{' / '.join(loose)} need an exit_criterion (one of {ad.CRITERIA}); Ouro's pick "
                                 "of the pass that feeds the head is early_exit_threshold")
            if draft_loops is not None:
                return Speculative(loops=loops, exit_at_step=exit_at_step, early_exit_threshold=early_exit_threshold,
                                   draft_loops=draft_loops, lookahead=lookahead)
            return Fixed(loops=loops, exit_at_step=exit_at_step, early_exit_threshold=early_exit_threshold)
        if exit_at_step is not None or early_exit_threshold is not None:
            raise ValueError("exit_at_step / early_exit_threshold pick a pass of a full-depth run; they do not go "
                             "with exit_criterion")
        if draft_loops is not None:
            raise ValueError("draft_loops (speculative decoding) does not go with exit_criterion")
        return Adaptive(loops=loops, criterion=exit_criterion, threshold=exit_threshold, min_steps=min_steps,
                        check_every=check_every, continuous_compute=continuous_compute, in_prefill=exit_in_prefill)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fixed(DepthPlan):
    """Every pass runs. exit_at_step / early_exit_threshold (gate models): which pass's output
    feeds the head (None: the model's default pick)."""

    exit_at_step: int | None = None
    early_exit_threshold: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speculative(Fixed):
    """Self-speculative decoding: `lookahead` tokens drafted at depth draft_loops from the same
    caches, verified at `loops` in one forward (greedy: the same tokens as `Fixed`)."""

    draft_loops: int = 1
    lookahead: int = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adaptive(DepthPlan):
    """Adaptive depth (`model.adaptive`): a token's passes stop when `criterion` says so.
    in_prefill: the prompt is one chunk that exits as a whole (else it runs every pass)."""

    criterion: str
    threshold: float | None = None
    min_steps: int = 0
    check_every: int = 1
    continuous_compute: bool = False
    in_prefill: bool = False


# `DepthPlan.of`'s keywords and their defaults
_PLAN_DEFAULTS = dict(loops=None, exit_at_step=None, early_exit_threshold=None, exit_criterion=None,
                      exit_threshold=None, min_steps=0, check_every=1, continuous_compute=False,
                      exit_in_prefill=False, draft_loops=None, lookahead=4)
_SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
PLAN_FIELDS = tuple(_PLAN_DEFAULTS)
SAMPLING_FIELDS = tuple(_SAMPLING_DEFAULTS)
KEYWORDS = SAMPLING_FIELDS + PLAN_FIELDS + ("params", "plan", "cache_window")  # `from_keywords`'


def flat(plan: DepthPlan) -> dict:
    """A plan as the flat keywords `DepthPlan.of` takes (its inverse)."""
    out = dict(loops=plan.loops)
    if isinstance(plan, Fixed):
        out.update(exit_at_step=plan.exit_at_step, early_exit_threshold=plan.early_exit_threshold)
    if isinstance(plan, Speculative):
        out.update(draft_loops=plan.draft_loops, lookahead=plan.lookahead)
    if isinstance(plan, Adaptive):
        out.update(exit_criterion=plan.criterion, exit_threshold=plan.threshold, min_steps=plan.min_steps,
                   check_every=plan.check_every, continuous_compute=plan.continuous_compute,
                   exit_in_prefill=plan.in_prefill)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One request: continue `prompt` choosing tokens by `params`, `plan` deep; cache_window > 0:
    every query attends to the last cache_window positions only; deadline: a
    `time.perf_counter()` time after which the engine gives up (None: never).

    A request `checked` against a model carries its plan with `loops` resolved and, when
    adaptive, its `policy` built; `Engine.submit` and the `generate*` methods take it as is."""

    prompt: Annotated[np.ndarray, "int32[T]"]
    params: SamplingParams = SamplingParams()
    plan: DepthPlan = Fixed()
    cache_window: int = 0
    deadline: float | None = None
    policy: ad.Policy | None = dataclasses.field(default=None, init=False, repr=False)  # set by `checked`
    checked_for: ModelConfig | None = dataclasses.field(default=None, init=False, repr=False)

    @property
    def loops(self) -> int | None:
        return self.plan.loops

    @property
    def speculation(self) -> Speculation | None:
        return Speculation(self.plan.draft_loops, self.plan.lookahead) if isinstance(self.plan, Speculative) else None

    @property
    def in_prefill(self) -> bool:
        return isinstance(self.plan, Adaptive) and self.plan.in_prefill

    @property
    def exit_pick(self) -> tuple[int | None, float | None]:
        """(exit_at_step, early_exit_threshold): the request's own exit pick (None, None: the model's)."""
        plan = self.plan
        return (plan.exit_at_step, plan.early_exit_threshold) if isinstance(plan, Fixed) else (None, None)


def _one(kind, value, fields: dict, defaults: dict) -> None:
    """`value` (a `kind`) or the same knobs as keywords (`fields`), never both: the keywords are sugar."""
    if not isinstance(value, kind):
        raise ValueError(f"expected a {kind.__name__}, got {type(value).__name__}")
    given = sorted(k for k, v in fields.items() if not check.same(v, defaults[k]))
    if given:
        raise ValueError(f"pass {', '.join(given)} inside the {kind.__name__} or as keywords, not both")


def params_of(params: SamplingParams | None, keywords: dict) -> SamplingParams:
    """`params`, or a SamplingParams of the sampling keywords in `keywords` (not both)."""
    fields = {k: v for k, v in keywords.items() if k in _SAMPLING_DEFAULTS}
    if params is None:
        return SamplingParams(**fields)
    _one(SamplingParams, params, fields, _SAMPLING_DEFAULTS)
    return params


def plan_of(plan: DepthPlan | None, keywords: dict) -> DepthPlan:
    """`plan`, or the DepthPlan of the depth keywords in `keywords` (not both)."""
    fields = {k: v for k, v in keywords.items() if k in _PLAN_DEFAULTS}
    if plan is None:
        return DepthPlan.of(**fields)
    _one(DepthPlan, plan, fields, _PLAN_DEFAULTS)
    return plan


def from_keywords(prompt, params: SamplingParams | None = None, plan: DepthPlan | None = None, cache_window: int = 0,
                  deadline: float | None = None, **keywords) -> Request:
    """A Request from `generate`'s keywords: params / plan, or their fields as keywords. A
    Request passed as `prompt` is returned as is (every keyword left at its default)."""
    unknown = sorted(set(keywords) - set(_SAMPLING_DEFAULTS) - set(_PLAN_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: "
                         f"{', '.join(SAMPLING_FIELDS + PLAN_FIELDS + ('cache_window', 'timeout'))}")
    if isinstance(prompt, Request):
        given = dict(keywords, params=params, plan=plan, cache_window=cache_window or None, deadline=deadline)
        _one(Request, prompt, given, dict(_SAMPLING_DEFAULTS, **_PLAN_DEFAULTS, params=None, plan=None,
                                          cache_window=None, deadline=None))
        return prompt
    return Request(prompt, params_of(params, keywords), plan_of(plan, keywords), cache_window, deadline)


def exit_pick(config: ModelConfig, loops: int, exit_at_step=None, early_exit_threshold=None):
    """The checked exit pick at `loops` (Ouro's choice of the pass that feeds the head): the
    arguments, else the model's defaults; (None, None) when neither says (the last pass)."""
    if not config.early_exit_gate:
        if exit_at_step is not None or early_exit_threshold is not None:
            raise ValueError("exit_at_step / early_exit_threshold need a model with an early-exit gate (Ouro); "
                             "this model has none")
        return None, None
    step = config.early_exit_step if exit_at_step is None else check.integer(exit_at_step, "exit_at_step")
    thr = (config.early_exit_threshold if early_exit_threshold is None
           else check.unit_interval(early_exit_threshold, "early_exit_threshold"))
    if step is not None and not 0 <= step < loops:
        raise ValueError(f"exit_at_step={step} is not a pass of this call (0 <= step < loops={loops})")
    return step, thr


def checked_plan(plan: DepthPlan, config: ModelConfig) -> tuple[DepthPlan, ad.Policy | None]:
    """`plan` against the model: its loops resolved (None: the model's default) and checked,
    each kind's knobs checked; an adaptive plan's `Policy` built. ValueError naming the value."""
    if not isinstance(plan, DepthPlan) or type(plan) is DepthPlan:
        raise ValueError(f"plan must be a Fixed, Speculative or Adaptive DepthPlan, got {plan!r}")
    loops = config.default_loops if plan.loops is None else check.loops(plan.loops)
    plan = dataclasses.replace(plan, loops=loops)
    if isinstance(plan, Fixed):
        exit_pick(config, loops, plan.exit_at_step, plan.early_exit_threshold)
    if isinstance(plan, Speculative):
        check.speculation(plan.draft_loops, plan.lookahead, loops)
    if not isinstance(plan, Adaptive):
        return plan, None
    if not isinstance(plan.in_prefill, bool):
        raise ValueError(f"exit_in_prefill must be True or False, got {plan.in_prefill!r}")
    return plan, ad.make_policy(config, loops, plan.criterion, plan.threshold, plan.min_steps, plan.check_every,
                                plan.continuous_compute)


def checked(request: Request, config: ModelConfig, allow_empty: bool = False, name: str = "prompt") -> Request:
    """`request` checked against the model (ValueError naming the bad value): prompt ids in the
    vocabulary (a fresh int32 copy), every sampling knob (`validation.sampling_params`), the
    plan (`checked_plan`), the window. Lengths against the context are the caller's (a prefix,
    a lookahead add to them). A request already checked for this config is returned as is."""
    if not isinstance(request, Request):
        raise ValueError(f"expected a Request, got {type(request).__name__}")
    if request.checked_for == config:
        return request
    if not isinstance(request.params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(request.params).__name__}")
    prompt = check.tokens(request.prompt, config.vocab_size, name, allow_empty)
    params = check.sampling_params(config.vocab_size, **dataclasses.asdict(request.params))
    plan, policy = checked_plan(request.plan, config)
    out = Request(prompt, params, plan, check.cache_window(request.cache_window), request.deadline)
    object.__setattr__(out, "policy", policy)
    object.__setattr__(out, "checked_for", config)
    return out


def with_deadline(request: Request, deadline: float | None) -> Request:
    """`request` with another deadline, still checked (the check does not read the deadline)."""
    out = dataclasses.replace(request, deadline=deadline)
    object.__setattr__(out, "policy", request.policy)
    object.__setattr__(out, "checked_for", request.checked_for)
    return out
