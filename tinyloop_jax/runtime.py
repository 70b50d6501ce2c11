"""`Model`: the Python-side object at the API edge — validation, errors, and host/device glue.

Every request is served the same way: a prompt (or prefix) segment that is only read, plus
an own segment that the request writes. `generate(prompt)` is literally "build a prefix of
the prompt, then generate from it".
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as kvc
from . import batch, checkpoint, engine, hf_gpt2, speculative
from . import functional as F
from . import validation as check
from .config import ModelConfig, check_kv_mode
from .params import Params, Weights, check_shapes, params_digest, random_params
from .prefix import PrefixCache
from .sampling import SamplingParams, StopSpec


class Model:
    """A looped GPT-2-style LM with prefix caching.

    >>> import tinyloop_jax as tl
    >>> model = tl.Model.random(tl.ModelConfig(vocab_size=256, default_loops=4), seed=0)
    >>> prefix = model.build_prefix_cache([1, 2, 3, 4], loops=4)
    >>> out = model.generate_from_prefix_cache(prefix, max_tokens=8, suffix=[5, 6])
    >>> len(out) <= 4 + 2 + 8
    True
    """

    def __init__(self, params: Params, config: ModelConfig):
        check_shapes(params, config)
        self._params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
        self._config = config
        self._closed = False
        self._token = object()  # identity for prefixes built by this instance
        self._fingerprint = None
        self._lock = threading.Lock()
        self.last_speculation: dict | None = None  # rounds / drafted / accepted of the last speculative call

    # ---- construction, persistence, lifetime -------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> "Model":
        return cls(random_params(config, seed), config)

    @classmethod
    def from_hf_gpt2(cls, path: str, kv_mode: str | None = None) -> "Model":
        """A Hugging Face GPT-2 folder (config.json + model.safetensors, any size) as a model
        with n_pre_blocks = n_layer - 1 and default_loops = 1. See `hf_gpt2`."""
        return cls(*hf_gpt2.load(path, kv_mode))

    @classmethod
    def load(cls, path: str, kv_mode: str | None = None) -> "Model":
        """Load weights + config saved by `save`; `kv_mode` overrides the saved mode."""
        arrays, meta = checkpoint.load(path, "model")
        config = ModelConfig.from_dict(meta["config"])
        if kv_mode is not None:
            config = ModelConfig.from_dict(dict(config.to_dict(), kv_mode=check_kv_mode(kv_mode)))
        return cls(_unflatten_params(arrays, config), config)

    def save(self, path: str) -> None:
        """Write weights and config to a new folder (orbax), atomically."""
        self._check_open()
        arrays = checkpoint.flatten(_params_to_tree(self._params))
        checkpoint.save(path, "model", arrays, {"config": self._config.to_dict()})

    def close(self) -> None:
        """Release the weights; every later call raises RuntimeError."""
        self._closed = True
        self._params = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("model was closed; construct or load a new Model")

    def config(self) -> dict:
        self._check_open()
        return self._config.to_dict()

    @property
    def weights(self) -> Weights:
        """Params + config, the input of the pure functions in `tinyloop_jax.functional`."""
        self._check_open()
        return Weights(params=self._params, config=self._config)

    @property
    def fingerprint(self) -> str:
        """sha256 of the config (mode included) and every weight; computed once."""
        self._check_open()
        with self._lock:
            if self._fingerprint is None:
                cfg = json.dumps(self._config.to_dict(), sort_keys=True)
                self._fingerprint = hashlib.sha256((cfg + params_digest(self._params)).encode()).hexdigest()
            return self._fingerprint

    def cache_nbytes(self, seq_len: int, loops: int | None = None) -> int:
        """Bytes of a cache holding `seq_len` positions at depth `loops` (exact, unbucketed)."""
        self._check_open()
        c = self._config
        loops = c.default_loops if loops is None else check.loops(loops)
        return kvc.cache_nbytes(c.kv_mode, c.n_cache_layers(loops), c.n_heads, seq_len, c.head_dim)

    # ---- internals ---------------------------------------------------------------------------

    def _loops(self, loops) -> int:
        return self._config.default_loops if loops is None else check.loops(loops)

    def _empty(self, n_tokens: int, loops: int, window: int, start: int = 0) -> kvc.KVCache:
        return F.empty_cache(self.weights, n_tokens, loops, window, start)

    def _prefill(self, tokens: np.ndarray, ro: tuple, own: kvc.KVCache, loops: int, window: int):
        """Append `tokens` to `own` (bucket-padded chunk). Returns (logits [V] device, own)."""
        return F.prefill(self.weights, tokens, own, ro, loops=loops, cache_window=window)

    def _check_length(self, n_tokens: int, what: str) -> None:
        if n_tokens > self._config.max_seq_len:
            raise RuntimeError(f"{what} is {n_tokens} tokens, longer than max_seq_len={self._config.max_seq_len}")

    def _build(self, prompt: np.ndarray, loops: int, window: int, keep_state: bool = False) -> PrefixCache:
        own = self._empty(len(prompt), loops, window)
        logits, own, state, depth = self._prefill_states(prompt, 0, own, loops, window)
        return self._wrap(own, prompt, logits, loops, window, depth, state if keep_state else None)

    def _prefill_states(self, tokens: np.ndarray, start: int, own: kvc.KVCache, loops: int, window: int):
        padded = np.zeros((kvc.bucket(len(tokens)),), np.int32)
        padded[:len(tokens)] = tokens
        return engine.prefill_states(self._params, self._config, jnp.asarray(padded), jnp.int32(len(tokens)),
                                     jnp.int32(start), own, loops=loops, window=window)

    def _at_depth(self, prefix: PrefixCache, loops) -> PrefixCache:
        self._check_open()
        self._check_prefix(prefix)
        loops, c = check.loops(loops), self._config
        if loops == prefix.loops:
            return prefix
        n = c.n_cache_layers(loops)
        if loops < prefix.loops:
            if prefix.depth_states is None:
                raise RuntimeError("this prefix has no per-depth states (saved by an older version); rebuild it")
            logits = engine.logits_from_state(self._params, c.layer_norm_eps, jnp.asarray(prefix.depth_states[n - 1]))
            cache = prefix.cache.replace(layers=prefix.cache.layers[:n])
            return self._wrap(cache, prefix.prompt, logits, loops, prefix.cache_window, prefix.depth_states[:n])
        if prefix.state is None:
            raise RuntimeError(f"loops={loops} is deeper than the prefix's loops={prefix.loops} and the prefix "
                               "did not keep its loop state; build it with keep_state=True (or rebuild at "
                               f"loops={loops})")
        first = prefix.cache.n_layers
        extra = kvc.empty(c.kv_mode, n - first, c.n_heads, prefix.cache.capacity, c.head_dim)
        logits, extra, state, depth = engine.continue_depth(self._params, c, prefix.state, jnp.int32(len(prefix)),
                                                            extra, first=first, last=n, window=prefix.cache_window)
        cache = prefix.cache.replace(layers=prefix.cache.layers + extra.layers)
        depth = np.concatenate([prefix.depth_states, np.asarray(depth, np.float32)])
        return self._wrap(cache, prefix.prompt, logits, loops, prefix.cache_window, depth, state)

    def _extend_prefix(self, source: PrefixCache, k: int, prompt: np.ndarray) -> PrefixCache:
        """The prefix of `prompt` whose first k tokens are source's first k: those positions are
        copied (no compute), only prompt[k:] is prefilled. Needs 0 < k < len(prompt)."""
        self._check_prefix(source)
        loops, window = source.loops, source.cache_window
        own = engine.copy_prefix(source.cache, jnp.int32(k), capacity=kvc.segment_capacity(len(prompt), window))
        logits, own, _, depth = self._prefill_states(prompt[k:], k, own, loops, window)
        return self._wrap(own, prompt, logits, loops, window, depth)

    def _wrap(self, own: kvc.KVCache, prompt: np.ndarray, logits, loops: int, window: int, depth_states=None,
              state=None) -> PrefixCache:
        prompt = prompt.copy()
        prompt.setflags(write=False)
        logits = np.asarray(logits, np.float32)
        logits.setflags(write=False)
        if depth_states is not None:
            depth_states = np.array(depth_states, np.float32)
            depth_states.setflags(write=False)
        return PrefixCache(cache=own, prompt=prompt, loops=loops, cache_window=window,
                           kv_mode=self._config.kv_mode, logits=logits,
                           model_fingerprint=self.fingerprint, model_token=self._token,
                           depth_states=depth_states, state=state, model_ref=weakref.ref(self))

    def _check_prefix(self, prefix) -> None:
        if not isinstance(prefix, PrefixCache):
            raise ValueError(f"prefix must be a PrefixCache from build_prefix_cache, got {type(prefix).__name__}")
        if prefix.model_token is not self._token and prefix.model_fingerprint != self.fingerprint:
            raise ValueError("prefix was built by another model (weights, config or kv_mode differ)")

    def _call_segments(self, ro: tuple) -> tuple[tuple, str | None]:
        """(read-only segments for one call, kv_mode of the call's own segment). h modes:
        rebuild the prefix's K/V once for the whole call (every decode step, every request of a
        batch reads that copy) and keep the request's own K/V in float32 while it runs; the
        prefix at rest stays in h form, the rebuilt copy lives only during the call."""
        if not self._config.kv_mode.endswith("-h"):
            return ro, None
        return tuple(engine.materialize(self._params, self._config, seg) for seg in ro), "fp32"

    def _decode(self, prefix: PrefixCache, suffix: np.ndarray, max_tokens: int, sampling: tuple,
                stop_sequences: list, loops: int, window: int, spec: tuple | None = None) -> list[int]:
        t, k, p, r, s = sampling
        P, n_suffix = len(prefix), len(suffix)
        ro, work_mode = self._call_segments((prefix.cache,))
        room, ring = n_suffix + max_tokens, window
        if spec is not None:  # a verify chunk writes lookahead + 1 positions before the rollback
            room, ring = room + spec[1] + 1, window + spec[1] + 1 if window else 0
        own = F.empty_cache(self.weights, room, loops, ring, start=P, kv_mode=work_mode)
        if n_suffix:
            logits, own = self._prefill(suffix, ro, own, loops, window)
        else:
            logits = jnp.asarray(prefix.logits)
        seen = np.zeros((self._config.vocab_size,), bool)
        seen[prefix.prompt] = True
        seen[suffix] = True
        args = (self._params, self._config, ro, own, logits, jnp.asarray(seen), SamplingParams.make(t, k, p, r, s),
                StopSpec.make(stop_sequences), jnp.int32(max_tokens))
        kw = dict(loops=loops, window=window, out_len=kvc.bucket(max_tokens, minimum=8))
        if spec is None:
            out, n, _ = engine.decode(*args, **kw)
        else:
            out, n, _, rounds, kept = speculative.decode(*args, **kw, draft_loops=spec[0], lookahead=spec[1])
            self.last_speculation = dict(rounds=int(rounds), drafted=int(rounds) * spec[1], accepted=int(kept))
        emitted = np.asarray(out)[: int(n)]
        return prefix.prompt.tolist() + suffix.tolist() + emitted.tolist()

    # ---- public API --------------------------------------------------------------------------

    def next_token_logits(self, prompt, loops: int | None = None, cache_window: int = 0) -> np.ndarray:
        """Next-token logits [V] float32 after `prompt`, by a from-scratch forward."""
        self._check_open()
        prompt = check.tokens(prompt, self._config.vocab_size)
        loops, window = self._loops(loops), check.cache_window(cache_window)
        self._check_length(len(prompt), "prompt")
        own = self._empty(len(prompt), loops, window)
        logits, _ = self._prefill(prompt, (), own, loops, window)
        return np.asarray(logits, np.float32)

    def generate(self, prompt, max_tokens: int = 32, loops: int | None = None, temperature: float = 0.0,
                 top_k: int = 50, top_p: float = 1.0, cache_window: int = 0, repetition_penalty: float = 1.0,
                 stop_sequences=(), seed: int = 0, draft_loops: int | None = None, lookahead: int = 4) -> list[int]:
        """Prompt + up to `max_tokens` emitted tokens (a list of ints).

        draft_loops=d: self-speculative decoding — draft `lookahead` tokens at depth d from the
        same caches, verify them in one forward at depth `loops` (see `speculative`). Greedy
        output is identical to plain decoding; sampled output has the same distribution.
        """
        self._check_open()
        prompt = check.tokens(prompt, self._config.vocab_size)
        max_tokens = check.max_tokens(max_tokens)
        loops, window = self._loops(loops), check.cache_window(cache_window)
        sampling = check.sampling(temperature, top_k, top_p, repetition_penalty, seed)
        stops = check.stop_sequences(list(stop_sequences), self._config.vocab_size)
        spec = self._spec(draft_loops, lookahead, loops)
        self._check_length(len(prompt) + max_tokens, "prompt + max_tokens")
        prefix = self._build(prompt, loops, window)
        return self._decode(prefix, np.zeros((0,), np.int32), max_tokens, sampling, stops, loops, window, spec)

    def _spec(self, draft_loops, lookahead, loops) -> tuple | None:
        if draft_loops is None:
            return None
        d, k = check.loops(draft_loops), check._int(lookahead, "lookahead")
        if d > loops:
            raise ValueError(f"draft_loops={d} must not exceed loops={loops}")
        if k < 1:
            raise ValueError(f"lookahead must be >= 1, got {k}")
        return d, k

    def build_prefix_cache(self, prompt, loops: int | None = None, cache_window: int = 0,
                           keep_state: bool = False) -> PrefixCache:
        """Prefill `prompt` once (no decode) into a PrefixCache for many later requests.
        keep_state=True also keeps every position's loop state (D floats per token), so that
        `prefix.at_depth(deeper)` runs only the extra iterations."""
        self._check_open()
        prompt = check.tokens(prompt, self._config.vocab_size)
        loops, window = self._loops(loops), check.cache_window(cache_window)
        if not isinstance(keep_state, bool):
            raise ValueError(f"keep_state must be True or False, got {keep_state!r}")
        self._check_length(len(prompt), "prompt")
        return self._build(prompt, loops, window, keep_state)

    def resume(self, prompt, loops: int | None = None, cache_window: int = 0) -> "ResumeHandle":
        """Prefill `prompt` at a (shallow) depth and return a handle to look at the result and
        continue deeper without recomputing what was done."""
        return ResumeHandle(self, self.build_prefix_cache(prompt, loops, cache_window, keep_state=True))

    def _prefix_call(self, prefix, loops, cache_window, suffix) -> tuple[int, int, np.ndarray]:
        self._check_prefix(prefix)
        loops = prefix.loops if loops is None else check.loops(loops)
        if loops != prefix.loops:
            raise RuntimeError(f"loops mismatch: the call asks for loops={loops} but the prefix was "
                               f"built at loops={prefix.loops}; rebuild the prefix at the target depth")
        window = prefix.cache_window if cache_window is None else check.cache_window(cache_window)
        if window != prefix.cache_window:
            raise RuntimeError(f"cache_window mismatch: the call asks for {window} but the prefix was "
                               f"built with cache_window={prefix.cache_window}")
        suffix = (np.zeros((0,), np.int32) if suffix is None
                  else check.tokens(suffix, self._config.vocab_size, name="suffix", allow_empty=True))
        return loops, window, suffix

    def generate_from_prefix_cache(self, prefix: PrefixCache, max_tokens: int = 32, loops: int | None = None,
                                   temperature: float = 0.0, top_k: int = 50, top_p: float = 1.0,
                                   cache_window: int | None = None, repetition_penalty: float = 1.0,
                                   stop_sequences=(), suffix=None, seed: int = 0, draft_loops: int | None = None,
                                   lookahead: int = 4) -> list[int]:
        """prefix.prompt + suffix + up to `max_tokens` emitted tokens. The prefix is only read.

        `loops` / `cache_window` default to the prefix's own; any other value is a RuntimeError.
        """
        self._check_open()
        loops, window, suffix = self._prefix_call(prefix, loops, cache_window, suffix)
        max_tokens = check.max_tokens(max_tokens)
        sampling = check.sampling(temperature, top_k, top_p, repetition_penalty, seed)
        stops = check.stop_sequences(list(stop_sequences), self._config.vocab_size)
        spec = self._spec(draft_loops, lookahead, loops)
        self._check_length(len(prefix) + len(suffix) + max_tokens, "prefix + suffix + max_tokens")
        return self._decode(prefix, suffix, max_tokens, sampling, stops, loops, window, spec)

    def _decode_batch(self, prefix: PrefixCache | None, suffixes: list, max_tokens: int, sampling: tuple,
                      stops: list, seeds: list, loops: int, window: int) -> list[list[int]]:
        """N requests, each = prefix (shared, read once per step for all) + its suffix + decode."""
        t, k, p, r, _ = sampling
        c, N = self._config, len(suffixes)
        P = 0 if prefix is None else len(prefix)
        lens = np.array([len(x) for x in suffixes], np.int32)
        ro, work_mode = self._call_segments(() if prefix is None else (prefix.cache,))
        own = F.empty_cache(self.weights, int(lens.max()) + max_tokens, loops, window, start=P,
                            kv_mode=work_mode, batch=N)
        logits = jnp.broadcast_to(jnp.asarray(prefix.logits), (N, c.vocab_size)) if prefix is not None else None
        if lens.max() > 0:
            tokens = np.zeros((N, kvc.bucket(int(lens.max()))), np.int32)
            for i, x in enumerate(suffixes):
                tokens[i, :len(x)] = x
            fresh, own = batch.prefill(self._params, c, jnp.asarray(tokens), jnp.asarray(lens),
                                       jnp.full((N,), P, jnp.int32), ro, own, loops=loops, window=window)
            logits = fresh if logits is None else jnp.where(jnp.asarray(lens > 0)[:, None], fresh, logits)
        seen = np.zeros((N, c.vocab_size), bool)
        for i, x in enumerate(suffixes):
            seen[i, x] = True
            if prefix is not None:
                seen[i, prefix.prompt] = True
        out, n, _ = batch.decode(self._params, c, ro, own, logits, jnp.asarray(seen),
                                 SamplingParams.make_batch(t, k, p, r, seeds), StopSpec.make_batch(stops),
                                 jnp.int32(max_tokens), loops=loops, window=window,
                                 out_len=kvc.bucket(max_tokens, minimum=8))
        out, n = np.asarray(out), np.asarray(n)
        head = [] if prefix is None else prefix.prompt.tolist()
        return [head + x.tolist() + out[i, : n[i]].tolist() for i, x in enumerate(suffixes)]

    def generate_batch_from_prefix_cache(self, prefix: PrefixCache, suffixes, max_tokens: int = 32,
                                         loops: int | None = None, temperature: float = 0.0, top_k: int = 50,
                                         top_p: float = 1.0, cache_window: int | None = None,
                                         repetition_penalty: float = 1.0, stop_sequences=(),
                                         seeds=None) -> list[list[int]]:
        """N requests off one prefix, decoded together: the i-th result equals
        `generate_from_prefix_cache(prefix, suffix=suffixes[i], seed=seeds[i], ...)`.

        Suffixes may differ in length (or be empty). `stop_sequences` is one list for all
        requests or one list per request; `seeds` one per request (default 0 each). The prefix
        is read once per step for the whole batch and never copied or written.
        """
        self._check_open()
        loops, window, _ = self._prefix_call(prefix, loops, cache_window, None)
        suffixes = check.token_lists(suffixes, self._config.vocab_size, "suffixes", allow_empty=True)
        return self._batch_call(prefix, suffixes, max_tokens, (temperature, top_k, top_p, repetition_penalty),
                                stop_sequences, seeds, loops, window)

    def generate_batch(self, prompts, max_tokens: int = 32, loops: int | None = None, temperature: float = 0.0,
                       top_k: int = 50, top_p: float = 1.0, cache_window: int = 0, repetition_penalty: float = 1.0,
                       stop_sequences=(), seeds=None) -> list[list[int]]:
        """Unrelated prompts decoded together (ragged, padded and masked): the i-th result
        equals `generate(prompts[i], seed=seeds[i], ...)`."""
        self._check_open()
        prompts = check.token_lists(prompts, self._config.vocab_size, "prompts", allow_empty=False)
        return self._batch_call(None, prompts, max_tokens, (temperature, top_k, top_p, repetition_penalty),
                                stop_sequences, seeds, self._loops(loops), check.cache_window(cache_window))

    def _batch_call(self, prefix, suffixes, max_tokens, knobs, stop_sequences, seeds, loops, window):
        max_tokens = check.max_tokens(max_tokens)
        sampling = check.sampling(*knobs, 0)
        stops = check.batch_stop_sequences(stop_sequences, len(suffixes), self._config.vocab_size)
        seeds = check.seeds(seeds, len(suffixes))
        P = 0 if prefix is None else len(prefix)
        self._check_length(P + max(len(x) for x in suffixes) + max_tokens, "prefix + longest suffix + max_tokens")
        return self._decode_batch(prefix, suffixes, max_tokens, sampling, stops, seeds, loops, window)

    def next_token_logits_from_prefix(self, prefix: PrefixCache, suffix, loops: int | None = None) -> np.ndarray:
        """Next-token logits [V] float32 after prefix.prompt + suffix, reusing the prefix."""
        self._check_open()
        loops, window, suffix = self._prefix_call(prefix, loops, None, suffix)
        self._check_length(len(prefix) + len(suffix), "prefix + suffix")
        if len(suffix) == 0:
            return np.array(prefix.logits)
        own = self._empty(len(suffix), loops, window, start=len(prefix))
        logits, _ = self._prefill(suffix, (prefix.cache,), own, loops, window)
        return np.asarray(logits, np.float32)


class ResumeHandle:
    """One request's prompt, prefilled at some depth with its loop state kept.

    >>> h = model.resume(prompt, loops=2)      # shallow: cheap first look
    >>> h.logits.argmax()                      # next-token logits at depth 2
    >>> h = h.deeper(6)                        # runs iterations 3..6 only
    >>> out = h.generate(max_tokens=32)        # decode at depth 6 from the deep prefix
    """

    def __init__(self, model: Model, prefix: PrefixCache):
        self.model, self.prefix = model, prefix

    @property
    def loops(self) -> int:
        return self.prefix.loops

    @property
    def logits(self) -> np.ndarray:
        return self.prefix.logits

    def deeper(self, loops: int) -> "ResumeHandle":
        if check.loops(loops) < self.loops:
            raise ValueError(f"deeper(loops={loops}) is shallower than the handle's loops={self.loops}; "
                             "use handle.prefix.at_depth for shallower views")
        return ResumeHandle(self.model, self.prefix.at_depth(loops))

    def generate(self, max_tokens: int = 32, **kw) -> list[int]:
        return self.model.generate_from_prefix_cache(self.prefix, max_tokens=max_tokens, **kw)

    def __repr__(self) -> str:
        return f"ResumeHandle(len={len(self.prefix)}, loops={self.loops})"


# ---- params <-> flat arrays -------------------------------------------------------------------

def _params_to_tree(params: Params) -> dict:
    blk = lambda b: {k: getattr(b, k) for k in b.__dataclass_fields__}  # noqa: E731
    return {"wte": params.wte, "wpe": params.wpe, "lnf_g": params.lnf_g, "lnf_b": params.lnf_b,
            "pre": [blk(b) for b in params.pre], "loop": blk(params.loop)}


def _unflatten_params(arrays: dict, config: ModelConfig) -> Params:
    from .params import BlockParams

    def blk(prefix):
        names = BlockParams.__dataclass_fields__
        missing = [f"{prefix}.{n}" for n in names if f"{prefix}.{n}" not in arrays]
        if missing:
            raise ValueError(f"checkpoint lacks tensor {missing[0]}")
        return BlockParams(**{n: arrays[f"{prefix}.{n}"] for n in names})

    for name in ("wte", "wpe", "lnf_g", "lnf_b"):
        if name not in arrays:
            raise ValueError(f"checkpoint lacks tensor {name}")
    return Params(wte=arrays["wte"], wpe=arrays["wpe"], lnf_g=arrays["lnf_g"], lnf_b=arrays["lnf_b"],
                  pre=tuple(blk(f"pre.{i}") for i in range(config.n_pre_blocks)), loop=blk("loop"))
