"""`Model`: the Python-side object at the API edge — argument checks, errors, and the host <->
device conversion around the pure pipeline in `functional`.

Every request is served the same way: a prompt (or prefix) segment that is only read, plus
an own segment that the request writes. `generate(prompt)` is literally "build a prefix of
the prompt, then generate from it".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..model import adaptive as ad
from ..model import cache as kvc
from ..formats import checkpoint
from ..decoding import programs
from ..formats import hf_gpt2
from ..formats import gguf, hf_import, hub
from .. import native
from ..model import qarray, sharding, stack
from . import functional as F
from . import request as R
from . import validation as check
from ..model.config import ModelConfig, check_kv_mode
from ..decoding.paged_decode import Decoded
from ..decoding.sampling import Knobs, SamplingParams
from ..decoding.scoring import Scores
from ..model.params import (Params, Weights, check_shapes, check_weight_mode, nbytes, quantize_params, with_layers)
from ..model.init import random_params
from .prefix import PrefixCache, ResumeHandle
from ..model.exits import Exit


class Model:
    """A looped LM (GPT-2 or Llama-family blocks, a looped stack, Ouro) with prefix caching.

    >>> import tinyloop_jax as tl
    >>> model = tl.Model.random(tl.ModelConfig(vocab_size=256, default_loops=4), seed=0)
    >>> prefix = model.build_prefix_cache([1, 2, 3, 4], loops=4)
    >>> out = model.generate_from_prefix_cache(prefix, max_tokens=8, suffix=[5, 6])
    >>> len(out) <= 4 + 2 + 8
    True
    """

    def __init__(self, params: Params, config: ModelConfig, mesh=None, activations: str | None = None):
        """params shaped as `param_shapes(config)`; with `mesh` (a ('data', 'model') Mesh, see
        `sharding`) they are placed on it and every call runs on it. `activations`: what packed
        weights multiply, "float32" (the inputs as computed) or "int8" (each row's inputs rounded
        to 8 bits per 32, with AVX-512 VNNI multiplied as integers: llama.cpp's arithmetic, 1.4-1.7x
        faster products, logits within ~1% of float32's; `qarray.round_activations`); None: float32."""
        params = params.replace(pre=stack.unstacked(params.pre))  # (another model's may be stacked)
        check_shapes(params, config)
        if activations is not None:
            params = qarray.with_activations(params, activations)
        params = jax.tree.map(lambda a: a if qarray.is_quant(a) else jnp.asarray(a, config.compute_dtype), params,
                              is_leaf=qarray.is_quant)  # packed weights stay packed
        params = with_layers(params, config)  # each block's window and RoPE base, from the config
        if mesh is not None:
            sharding.check(mesh, config)
            config = config.replace(mesh=mesh)
            params = sharding.place_params(params, config, mesh)
        elif native.available():  # packed weights in the native kernel's layout, once; pre blocks whose
            params = qarray.tile_params(params)  # matrices it reads in place stacked (a layer loop)
            params = params.replace(pre=stack.stack(params.pre)) if stack.read_in_place(params.pre) else params
        self._weights: Weights | None = Weights.create(params, config)
        self._config = config
        self.last_speculation: dict | None = None  # rounds / drafted / accepted of the last speculative call
        # passes run for each emitted token by the last call with an exit_criterion (a list; the
        # batched calls: one list per row); None after a call without one
        self.last_passes: list | None = None

    # ---- construction, persistence, lifetime -------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, mesh=None, quantize_weights: str | None = None,
               activations: str | None = None) -> "Model":
        """Seeded random weights (`quantize_weights`, `activations`: see `from_pretrained`)."""
        return cls(quantize_params(random_params(config, seed), config, quantize_weights), config, mesh, activations)

    @classmethod
    def from_hf_gpt2(cls, path: str, kv_mode: str | None = None) -> "Model":
        """A Hugging Face GPT-2 folder (config.json + model.safetensors, any size) as a model
        with n_pre_blocks = n_layer - 1 and default_loops = 1. See `hf_gpt2`."""
        return cls(*hf_gpt2.load(path, kv_mode))

    @classmethod
    def from_pretrained(cls, path: str, kv_mode: str | None = None, dtype: str | None = None,
                        mesh=None, quantize_weights: str | None = None, activations: str | None = None,
                        kv_share: str | None = None) -> "Model":
        """A Hugging Face folder (config.json + model.safetensors, or shards with
        model.safetensors.index.json) by its `model_type`: "gpt2", "llama" (n_pre = L - 1, one
        loop block run once) or "ouro" (the whole stack looped `total_ut_steps` times, early-exit
        gate). `dtype` (float32 | bfloat16) defaults to float32 on CPU and bfloat16 on GPU.
        Tensors are read one at a time (no second full copy in host memory). See `hf_import`.
        Also a GGUF file (or a folder holding one, see `formats.gguf`) and a known
        model name (`tl.model_path`: "smollm2").

        `quantize_weights`: None keeps weights as stored (a GGUF's Q8_0 / Q4_0 / Q4_1 matrices
        packed, bit for bit, see `qarray`; other GGUF types dequantized; a folder's floats
        float), "float" dequantizes everything to `dtype`, "int8" / "int4" quantize the matmul
        weights and the embedding / head (q8_0 / q4_0 blocks of 32; norms never).
        `activations`: see `Model` ("int8": packed weights multiply 8-bit inputs). `kv_share`:
        what later tokens read of a finished token's loop passes (`ModelConfig.kv_share`)."""
        path = hub.resolve(path)  # a known name ("smollm2") -> its local file
        if gguf.find_file(path) is not None:
            params, config = gguf.load(path, kv_mode, dtype, keep_packed=check_weight_mode(quantize_weights) is None)
        else:
            params, config = hf_import.load(path, kv_mode, dtype)
        config = config if kv_share is None else config.replace(kv_share=kv_share)
        return cls(quantize_params(params, config, quantize_weights), config, mesh=mesh, activations=activations)

    @classmethod
    def load(cls, path: str, kv_mode: str | None = None, mesh=None, quantize_weights: str | None = None,
             activations: str | None = None, kv_share: str | None = None) -> "Model":
        """Load weights + config saved by `save` (packed weights stay packed); `kv_mode` and
        `kv_share` override the saved ones; `mesh` places them on a ('data', 'model') mesh;
        `quantize_weights`, `activations`: see `from_pretrained` (`activations` is not saved)."""
        params, config = checkpoint.load_model(path)
        config = config if kv_mode is None else config.replace(kv_mode=check_kv_mode(kv_mode))
        config = config if kv_share is None else config.replace(kv_share=kv_share)
        return cls(quantize_params(params, config, quantize_weights), config, mesh, activations)

    def save(self, path: str) -> None:
        """Write weights (keyed by tree path) and config to a new folder (orbax), atomically."""
        checkpoint.save_model(path, self.weights.params, self.weights.config)

    def close(self) -> None:
        """Release the weights; every later call raises RuntimeError. (Prefixes built by this
        model hold a reference to the weights they were built with.)"""
        self._weights = None

    def config(self) -> dict:
        return self.weights.config.to_dict()

    @property
    def weights(self) -> Weights:
        """Params + config, the input of the pure functions in `tinyloop_jax.functional`."""
        if self._weights is None:
            raise RuntimeError("model was closed; construct or load a new Model")
        return self._weights

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as held (packed weights at their packed size)."""
        return nbytes(self.weights.params)

    @property
    def fingerprint(self) -> str:
        """sha256 of the config (mode included) and every weight; computed once, on first use."""
        return self.weights.fingerprint

    def cache_nbytes(self, seq_len: int, loops: int | None = None) -> int:
        """Bytes of a cache holding `seq_len` positions at depth `loops` (exact, unbucketed)."""
        c = self.weights.config
        loops = self._loops(loops)
        return kvc.cache_nbytes(c.kv_mode, c.n_cache_layers(loops), c.n_kv_heads, seq_len, c.head_dim, c.d_model)

    # ---- argument checks ---------------------------------------------------------------------

    def _loops(self, loops) -> int:
        return self._config.default_loops if loops is None else check.loops(loops)

    def exit_for(self, loops: int, exit_at_step=None, early_exit_threshold=None) -> Exit | None:
        """The early exit of a call at `loops` (Ouro's pick of the pass whose output feeds the
        head; no compute saved): the arguments, else the model's defaults (its early_exit_step /
        early_exit_threshold); None when neither says (the last pass). The serving engine asks
        it for a depth's default exit. (An exit_criterion's exit_threshold is another knob:
        adaptive depth, passes skipped.)"""
        step, thr = R.exit_pick(self._config, loops, exit_at_step, early_exit_threshold)
        return None if step is None and thr is None else Exit.make(step, thr)

    def _request(self, prompt, keywords: dict, allow_empty: bool = False, prefix: PrefixCache | None = None
                 ) -> R.Request:
        """A call's Request from its keywords (`keywords`: its locals; `request.from_keywords`),
        checked. Off a prefix, loops / cache_window left None are the prefix's own, and any
        other is a RuntimeError."""
        req = R.from_keywords(prompt, **{k: v for k, v in keywords.items() if k in R.KEYWORDS})
        if prefix is not None:
            self._check_prefix(prefix)
            req = R.Request(req.prompt, req.params, dataclasses.replace(req.plan, loops=prefix.loops)
                            if req.plan.loops is None else req.plan,
                            prefix.cache_window if req.cache_window is None else req.cache_window)
        req = R.checked(req, self._config, allow_empty, "prompt" if prefix is None else "suffix")
        if prefix is not None:
            self._prefix_matches(prefix, req.loops, req.cache_window)
            if req.in_prefill:
                raise ValueError("exit_in_prefill=True: a prefix was prefilled at full depth; pass the whole prompt "
                                 "to generate instead")
        return req

    def _batch_request(self, n: int, keywords: dict, prefix: PrefixCache | None = None
                       ) -> tuple[list[SamplingParams], R.Request]:
        """A batch call's values: one SamplingParams per request (`params`: one for every row or
        a list of one per row; else the keywords, `seeds` per row) and the shared plan and window
        as a checked Request with no prompt of its own."""
        sampling = [k for k in check.SAMPLING_FIELDS if k != "seed"] + ["seeds"]
        rows = check.batch_request(self._config.vocab_size, n, keywords["params"], {k: keywords[k] for k in sampling})
        plan = R.plan_of(keywords["plan"], {k: keywords[k] for k in R.PLAN_FIELDS if k in keywords})
        if isinstance(plan, R.Speculative):
            raise ValueError(f"draft_loops={plan.draft_loops}: a batch call does not speculate; call generate per "
                             "request, or submit them to an Engine")
        shared = dict(plan=plan, cache_window=keywords["cache_window"])
        return rows, self._request(np.zeros((0,), np.int32), shared, allow_empty=True, prefix=prefix)

    def _adaptive(self, req: R.Request, n: int = 1) -> F.Adaptive | None:
        """The call's adaptive depth (`model.adaptive`) for its n rows; None for a fixed depth."""
        return None if req.policy is None else F.Adaptive(ad.Policy.stack([req.policy] * n), req.in_prefill)

    def _exit(self, req: R.Request) -> Exit | None:
        """The call's exit pick (a fixed depth's; None: the last pass, or adaptive)."""
        return None if req.policy is not None else self.exit_for(req.loops, *req.exit_pick)

    def _tokens(self, ids, name: str = "prompt", allow_empty: bool = False) -> np.ndarray:
        return check.tokens(ids, self._config.vocab_size, name=name, allow_empty=allow_empty)

    def _check_length(self, n_tokens: int, what: str) -> None:
        if n_tokens > self._config.max_seq_len:
            raise RuntimeError(f"{what} is {n_tokens} tokens, longer than max_seq_len={self._config.max_seq_len}")

    def _check_prefix(self, prefix) -> None:
        if not isinstance(prefix, PrefixCache):
            raise ValueError(f"prefix must be a PrefixCache from build_prefix_cache, got {type(prefix).__name__}")
        if prefix.weights is not self.weights and prefix.model_fingerprint != self.fingerprint:
            raise ValueError("prefix was built by another model (weights, config or kv_mode differ)")

    def _prefix_matches(self, prefix: PrefixCache, loops: int, window: int) -> None:
        if loops != prefix.loops:
            raise RuntimeError(f"loops mismatch: the call asks for loops={loops} but the prefix was "
                               f"built at loops={prefix.loops}; rebuild the prefix at the target depth")
        if window != prefix.cache_window:
            raise RuntimeError(f"cache_window mismatch: the call asks for {window} but the prefix was "
                               f"built with cache_window={prefix.cache_window}")

    # ---- device -> host ----------------------------------------------------------------------

    def _lists(self, state: Decoded, heads: list, speculation: F.Speculation | None) -> list[list[int]]:
        """Row i: heads[i] (its prompt) + the tokens it emitted."""
        tokens, n = sharding.to_host(state.tokens), sharding.to_host(state.n)
        self.last_passes = None  # adaptive depth: the passes run for each emitted token, per row
        if state.passes is not None:
            depths = sharding.to_host(state.passes)
            self.last_passes = [depths[i, : n[i]].tolist() for i in range(len(heads))]
        if speculation is not None:
            rounds = int(state.rounds)
            self.last_speculation = dict(rounds=rounds, drafted=rounds * speculation.lookahead,
                                         accepted=int(sharding.to_host(state.accepted)[0]))
        return [list(h) + tokens[i, : n[i]].tolist() for i, h in enumerate(heads)]

    # ---- public API --------------------------------------------------------------------------

    def next_token_logits(self, prompt, loops: int | None = None, cache_window: int = 0,
                          exit_at_step: int | None = None, early_exit_threshold: float | None = None) -> np.ndarray:
        """Next-token logits [V] float32 after `prompt`, by a from-scratch forward.
        exit_at_step / early_exit_threshold (gate models): which pass's output gives them."""
        w = self.weights
        prompt = self._tokens(prompt)
        loops, window = self._loops(loops), check.cache_window(cache_window)
        ex = self.exit_for(loops, exit_at_step, early_exit_threshold)
        self._check_length(len(prompt), "prompt")
        logits, _ = F.prefill(w, prompt, F.empty_cache(w, len(prompt), loops, window), loops=loops,
                              cache_window=window, exit=ex)
        return sharding.to_host(logits, np.float32)

    def score(self, tokens, loops: int | None = None, top_logprobs: int = 0, seed: int = 0) -> Scores:
        """How likely the model finds `tokens` [n], by one from-scratch forward: numpy
        `Scores(logprobs [n], top_ids [n, top_logprobs], top_logprobs [n, top_logprobs])`, row i
        about token i given tokens[:i] (row 0 is zeros: nothing predicts the first token).
        Log-probabilities are the raw logits' log-softmax (the sampling knobs do not enter), at
        depth `loops` with the model's default exit; `seed`: injection models' initial states,
        as in `build_prefix_cache`. Summing logprobs[k:] gives the log-likelihood of a
        continuation tokens[k:] after the context tokens[:k]."""
        w = self.weights
        tokens = self._tokens(tokens)
        loops = self._loops(loops)
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, (int, np.integer)) \
                or not 0 <= top_logprobs <= w.config.vocab_size:
            raise ValueError(f"top_logprobs must be an int in [0, vocab_size={w.config.vocab_size}], "
                             f"got {top_logprobs!r}")
        self._check_length(len(tokens), "tokens")
        out = F.score(w, F.pad(tokens)[None], np.int32([len(tokens)]), loops, int(top_logprobs),
                      exit=self.exit_for(loops), seed=check.seed(seed))
        return Scores(*(sharding.to_host(a)[0, :len(tokens)] for a in out))

    def generate(self, prompt, max_tokens: int = 32, loops: int | None = None, temperature: float = 0.0,
                 top_k: int = 50, top_p: float = 1.0, cache_window: int = 0, repetition_penalty: float = 1.0,
                 stop_sequences=(), seed: int = 0, draft_loops: int | None = None, lookahead: int = 4,
                 exit_at_step: int | None = None, exit_threshold: float | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, logit_bias=None, early_exit_threshold: float | None = None,
                 exit_criterion: str | None = None, min_steps: int = 0, check_every: int = 1,
                 exit_in_prefill: bool = False, continuous_compute: bool = False,
                 response_format=None, params: SamplingParams | None = None,
                 plan: R.DepthPlan | None = None) -> list[int]:
        """Prompt + up to `max_tokens` emitted tokens (a list of ints).

        The request as two values: params (`SamplingParams`: max_tokens .. logit_bias) and plan
        (`DepthPlan`: loops, the exit pick, adaptive depth, speculation); the keywords are the
        same fields as sugar (one or the other for each value, not both). Or the whole request
        as one value: `generate(Request(prompt, params, plan, cache_window))`.

        presence_penalty / frequency_penalty (in [-2, 2]) and logit_bias ({token id: bias in
        [-100, 100]}, at most 300) as in OpenAI's API: a token's logit is lowered by
        frequency_penalty per time it was emitted so far and by presence_penalty once it was.

        draft_loops=d: self-speculative decoding — draft `lookahead` tokens at depth d from the
        same caches, verify them in one forward at depth `loops` (see `speculative`). Greedy
        output is identical to plain decoding; sampled output has the same distribution.

        Two exits with two names: exit_at_step / early_exit_threshold pick which pass's output
        feeds the head (Ouro's gate: the first pass whose exit CDF reaches the threshold; every
        pass still runs); exit_criterion + exit_threshold stop a token's passes early (adaptive
        depth, `model.adaptive`).
        """
        req = self._request(prompt, locals())
        prompt, params, spec = req.prompt, req.params, req.speculation
        self._check_length(len(prompt) + params.max_tokens, "prompt + max_tokens")
        state = F.generate(self.weights, [prompt], Knobs.from_params([params]), req.loops, req.cache_window, spec,
                           self._exit(req), self._adaptive(req), grammars=[params.response_format])
        out = self._lists(state, [prompt.tolist()], spec)[0]
        self.last_passes = self.last_passes and self.last_passes[0]
        return out

    def build_prefix_cache(self, prompt, loops: int | None = None, cache_window: int = 0,
                           keep_state: bool = False, seed: int = 0) -> PrefixCache:
        """Prefill `prompt` once (no decode) into a PrefixCache for many later requests.
        keep_state=True also keeps every position's loop state (D floats per token), so that
        `prefix.at_depth(deeper)` runs only the extra passes. `seed`: the prompt's initial loop
        states on a model with Huginn's recurrence (`generate(prompt, seed=s)` builds with s)."""
        w = self.weights
        prompt = self._tokens(prompt)
        loops, window = self._loops(loops), check.cache_window(cache_window)
        if not isinstance(keep_state, bool):
            raise ValueError(f"keep_state must be True or False, got {keep_state!r}")
        self._check_length(len(prompt), "prompt")
        kvc.check_fits(F.prefix_nbytes(w, len(prompt), loops, window), f"a prefix at loops={loops}")
        return F.build_prefix(w, prompt, loops, window, keep_state, self.exit_for(loops), seed=check.seed(seed))

    def resume(self, prompt, loops: int | None = None, cache_window: int = 0) -> "ResumeHandle":
        """Prefill `prompt` at a (shallow) depth and return a handle to look at the result and
        continue deeper without recomputing what was done."""
        return ResumeHandle(self, self.build_prefix_cache(prompt, loops, cache_window, keep_state=True))

    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = 32, loops: int | None = None,
                                   temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
                                   cache_window: int | None = None, repetition_penalty: float = 1.0,
                                   stop_sequences=(), suffix=None, seed: int = 0, draft_loops: int | None = None,
                                   lookahead: int = 4, exit_at_step: int | None = None,
                                   exit_threshold: float | None = None, presence_penalty: float = 0.0,
                                   early_exit_threshold: float | None = None,
                                   frequency_penalty: float = 0.0, logit_bias=None,
                                   exit_criterion: str | None = None, min_steps: int = 0, check_every: int = 1,
                                   exit_in_prefill: bool = False, continuous_compute: bool = False,
                                   response_format=None, params: SamplingParams | None = None,
                                   plan: R.DepthPlan | None = None) -> list[int]:
        """prefix.prompt + suffix + up to `max_tokens` emitted tokens. The prefix is only read.

        `loops` / `cache_window` default to the prefix's own; any other value is a RuntimeError.
        params / plan: the request as two values, as `generate` takes them.
        """
        w = self.weights
        r = self._request(np.zeros((0,), np.int32) if suffix is None else suffix, locals(), allow_empty=True,
                          prefix=prefix)
        suffix, params, spec, loops, window = r.prompt, r.params, r.speculation, r.loops, r.cache_window
        req = Knobs.from_params([params])
        self._check_length(len(prefix) + len(suffix) + params.max_tokens, "prefix + suffix + max_tokens")
        F.check_fits(w, [len(suffix)], req, loops, window, spec, prefix_len=len(prefix))
        state = F.decode(w, prefix, [suffix], req, loops, window, spec, self._exit(r), self._adaptive(r),
                         [params.response_format])
        out = self._lists(state, [prefix.prompt.tolist() + suffix.tolist()], spec)[0]
        self.last_passes = self.last_passes and self.last_passes[0]
        return out

    def generate_batch_from_prefix_cache(self, prefix: PrefixCache, suffixes, max_tokens: int = 32,
                                         loops: int | None = None, temperature: float = 0.0, top_k: int = 50,
                                         top_p: float = 1.0, cache_window: int | None = None,
                                         repetition_penalty: float = 1.0, stop_sequences=(), seeds=None,
                                         exit_at_step: int | None = None, exit_threshold: float | None = None,
                                         early_exit_threshold: float | None = None,
                                         presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                                         logit_bias=None, exit_criterion: str | None = None, min_steps: int = 0,
                                         check_every: int = 1, exit_in_prefill: bool = False,
                                         continuous_compute: bool = False, response_format=None, params=None,
                                         plan: R.DepthPlan | None = None) -> list[list[int]]:
        """N requests off one prefix, decoded together: the i-th result equals
        `generate_from_prefix_cache(prefix, suffix=suffixes[i], seed=seeds[i], ...)`.

        Suffixes may differ in length (or be empty). `stop_sequences` is one list for all
        requests or one list per request; `seeds` one per request (default 0 each). Or the
        request as values: params (one `SamplingParams` for every request, or a list of one
        per request) and plan (one `DepthPlan`). The prefix is read once per step for the
        whole batch and never copied or written.
        """
        w = self.weights
        suffixes = check.token_lists(suffixes, self._config.vocab_size, "suffixes", allow_empty=True)
        params, r = self._batch_request(len(suffixes), locals(), prefix)
        loops, window, ada, ex = r.loops, r.cache_window, self._adaptive(r, len(suffixes)), self._exit(r)
        req = Knobs.from_params(params)
        self._check_length(len(prefix) + max(len(x) for x in suffixes) + max(p.max_tokens for p in params),
                           "prefix + longest suffix + max_tokens")
        F.check_fits(w, [len(x) for x in suffixes], req, loops, window, prefix_len=len(prefix))
        state = F.decode(w, prefix, suffixes, req, loops, window, exit=ex, adaptive=ada,
                         grammars=[p.response_format for p in params])
        head = prefix.prompt.tolist()
        return self._lists(state, [head + x.tolist() for x in suffixes], None)

    def generate_batch(self, prompts, max_tokens: int = 32, loops: int | None = None, temperature: float = 0.0,
                       top_k: int = 50, top_p: float = 1.0, cache_window: int = 0, repetition_penalty: float = 1.0,
                       stop_sequences=(), seeds=None, exit_at_step: int | None = None,
                       exit_threshold: float | None = None, presence_penalty: float = 0.0,
                       early_exit_threshold: float | None = None,
                       frequency_penalty: float = 0.0, logit_bias=None,
                       exit_criterion: str | None = None, min_steps: int = 0, check_every: int = 1,
                       exit_in_prefill: bool = False, continuous_compute: bool = False, response_format=None,
                       params=None, plan: R.DepthPlan | None = None) -> list[list[int]]:
        """Unrelated prompts decoded together (ragged, padded and masked): the i-th result
        equals `generate(prompts[i], seed=seeds[i], ...)`. params / plan: as in
        `generate_batch_from_prefix_cache`."""
        w = self.weights
        prompts = check.token_lists(prompts, self._config.vocab_size, "prompts", allow_empty=False)
        params, r = self._batch_request(len(prompts), locals())
        loops, window, ada, ex = r.loops, r.cache_window, self._adaptive(r, len(prompts)), self._exit(r)
        self._check_length(max(len(x) for x in prompts) + max(p.max_tokens for p in params),
                           "longest prompt + max_tokens")
        state = F.generate(w, prompts, Knobs.from_params(params), loops, window, exit=ex, adaptive=ada,
                           grammars=[p.response_format for p in params])
        return self._lists(state, [x.tolist() for x in prompts], None)

    def next_token_logits_from_prefix(self, prefix: PrefixCache, suffix, loops: int | None = None,
                                      exit_at_step: int | None = None,
                                      early_exit_threshold: float | None = None) -> np.ndarray:
        """Next-token logits [V] float32 after prefix.prompt + suffix, reusing the prefix."""
        w = self.weights
        self._check_prefix(prefix)
        loops = prefix.loops if loops is None else check.loops(loops)
        self._prefix_matches(prefix, loops, prefix.cache_window)
        window, suffix = prefix.cache_window, self._tokens(suffix, "suffix", allow_empty=True)
        ex = self.exit_for(loops, exit_at_step, early_exit_threshold)
        self._check_length(len(prefix) + len(suffix), "prefix + suffix")
        if len(suffix) == 0:
            if ex is not None:
                return sharding.to_host(programs.prefix_logits(w.params, w.config, prefix.depth_states, loops, ex),
                                        np.float32)
            return sharding.to_host(prefix.logits, np.float32).copy()
        own = F.empty_cache(w, len(suffix), loops, window, start=len(prefix))
        logits, _ = F.prefill(w, suffix, own, (prefix.cache,), loops=loops, cache_window=window, exit=ex)
        return sharding.to_host(logits, np.float32)
