"""`PrefixCache`: a prompt's KV state, held immutably and shared by any number of requests.

Plain data and the one operation that derives a prefix from a prefix (`prefix_at_depth`);
building one is `functional.build_prefix`, saving and loading `formats.prefix_checkpoint`.
`ResumeHandle` (`Model.resume`) holds a prefix with its model, to look and go deeper.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..decoding import paged_decode, programs
from ..formats import prefix_checkpoint
from ..model import cache as kvc
from ..model import sharding
from . import validation as check
from ..model.cache import KVCache
from ..model.params import Weights
from ..model.exits import Exit


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixCache:
    """The prefilled state of `prompt` at depth `loops`, on the device.

    Requests read `cache` and never write it (each writes its own segment), so one handle
    serves serial and concurrent calls unchanged. `logits` are the next-token logits after the
    last prompt token, so the first decoded token needs no re-run of the prompt. A prefix
    refers to the `weights` it was built with (not to a `Model`).
    """

    cache: KVCache  # pre layers + at least `loops` passes (a shallower view shares a deeper prefix's)
    prompt: np.ndarray  # [P] int32, read-only host copy
    loops: int
    cache_window: int
    logits: jax.Array  # [V] float32
    seen: jax.Array  # [V] bool: the prompt's tokens (the repetition penalty's starting point)
    # the last prompt token's stream after each pre block and pass [n_pre + cache.passes, D]: the
    # logits of every depth the cache holds (`at_depth`), and every pass's exit gate
    depth_states: jax.Array
    weights: Weights = dataclasses.field(repr=False)
    # keep_state=True: every position's stream after the cache's last pass [T, D] (T = the
    # prompt's bucket), from which deeper passes continue without re-running what is done
    state: jax.Array | None = dataclasses.field(default=None, repr=False)
    # injection models (Huginn): the seed the prompt positions' initial loop states were drawn
    # from; a prefix extended from this one draws its new positions from it too
    seed: int = 0

    def __len__(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def kv_mode(self) -> str:
        return self.cache.kv_mode.name

    @property
    def model_fingerprint(self) -> str:
        """The fingerprint of the weights and config this prefix was built with (computed on use)."""
        return self.weights.fingerprint

    @property
    def nbytes(self) -> int:
        """Bytes of the cache buffers (K/V or their stored form, plus positions) and of the kept
        loop state if any; the per-prompt vectors (logits, seen, depth states: a few KiB) are
        not counted."""
        return self.cache.nbytes + (0 if self.state is None else int(self.state.nbytes))

    @property
    def nbytes_per_device(self) -> int:
        """`nbytes` on the device that holds the most of it (on a mesh the K/V are split over
        'model'; on one device this is `nbytes`)."""
        per: dict = {}
        for a in jax.tree.leaves(self.cache) + ([] if self.state is None else [self.state]):
            for s in a.addressable_shards:
                per[s.device] = per.get(s.device, 0) + int(s.data.nbytes)
        return max(per.values())

    @property
    def keeps_state(self) -> bool:
        return self.state is not None

    def at_depth(self, loops: int) -> "PrefixCache":
        """This prompt's prefix at another loop depth, without re-running what is done: for
        loops <= the passes held, a view of the first passes (shared arrays) and that depth's
        logits; deeper, only the missing passes, from the kept state (`keep_state=True`).
        Otherwise a RuntimeError. See `prefix_at_depth`."""
        return prefix_at_depth(self, check.loops(loops))

    def __repr__(self) -> str:
        return (f"PrefixCache(len={len(self)}, loops={self.loops}, cache_window={self.cache_window}, "
                f"kv_mode={self.kv_mode!r}, capacity={self.cache.capacity}, nbytes={self.nbytes})")

    # ---- persistence (see `formats.prefix_checkpoint`) -------------------------------------

    def save(self, path: str) -> None:
        """Write this prefix to a new folder `path` (orbax arrays keyed by tree path + a JSON
        record with the model fingerprint, mode, loops and window). Atomic: a failed save
        leaves nothing behind."""
        prefix_checkpoint.save(path, self)

    @classmethod
    def load(cls, path: str, model) -> "PrefixCache":
        """Load a prefix saved by `save` for use with `model`. A prefix of another model (or
        mode) is a ValueError; a damaged folder a RuntimeError or ValueError."""
        weights = model.weights
        return cls(**prefix_checkpoint.load(path, weights.fingerprint, weights.config.mesh, weights.config.kv_share),
                   weights=weights)


def prefix_at_depth(prefix: PrefixCache, loops: int, exit: Exit | None = None) -> PrefixCache:
    """The same prompt's prefix at depth `loops`, re-running nothing already done:
      * loops <= the passes its cache holds: a view of the first passes (the arrays are shared)
        with that depth's logits, from the stream kept after every layer;
      * deeper, with the loop state kept (keep_state=True): only the missing passes run;
      * otherwise a RuntimeError.
    `exit` (gate models): which pass the logits come from."""
    w, c = prefix.weights, prefix.weights.config
    if loops == prefix.loops:
        return prefix
    if loops <= prefix.cache.passes:
        if c.n_post_blocks:
            raise RuntimeError(f"the model's coda blocks were run at loops={prefix.cache.passes}: their cache does "
                               f"not hold depth {loops}; build the prefix at loops={loops}")
        logits = programs.prefix_logits(w.params, c, prefix.depth_states, loops=loops, exit=exit)
        return dataclasses.replace(prefix, loops=loops, logits=logits)
    if prefix.state is None:
        raise RuntimeError(f"loops={loops} is deeper than the prefix's loops={prefix.loops} and the prefix "
                           f"did not keep its loop state; build it with keep_state=True (or rebuild at loops={loops})")
    extra, n, cache = loops - prefix.cache.passes, len(prefix), prefix.cache
    # the extra passes from the stream after the last one, nothing before them re-run (the coda,
    # if any, runs again at the new depth), on pages of their own (their pre layers unused)
    grown = kvc.cache_nbytes(c.kv_mode, c.n_cache_layers(extra), c.n_kv_heads, cache.capacity, c.head_dim, c.d_model)
    pool, pages = paged_decode.prefix_pool(c, n, extra, grown + prefix.state.nbytes,
                                           f"{extra} more passes of a prefix of {n} tokens")
    own, logits, states, stream = paged_decode.fill_prefix(
        w.params, c, pool, pages, 0, np.asarray(prefix.state[:n]), extra, prefix.cache_window, None, prefix.seed,
        paged_decode.PREFILL_CHUNK, cache.capacity, cache.rings, cache.ring_capacity)
    state = jnp.pad(stream, ((0, prefix.state.shape[0] - n), (0, 0)))
    states = jnp.concatenate([prefix.depth_states, states])
    if c.early_exit_gate:
        logits = programs.prefix_logits(w.params, c, states, loops=loops, exit=exit)
    return dataclasses.replace(prefix, cache=kvc.append_passes(prefix.cache, own), loops=loops, logits=logits,
                               depth_states=states, state=state)


def tree_equal(a, b) -> bool:
    """Bit-identical pytrees (same structure, shapes, dtypes and bytes)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype for x, y in zip(la, lb)))


class ResumeHandle:
    """One request's prompt, prefilled at some depth with its loop state kept.

    >>> h = model.resume(prompt, loops=2)      # shallow: cheap first look
    >>> h.logits.argmax()                      # next-token logits at depth 2
    >>> h = h.deeper(6)                        # runs passes 3..6 only
    >>> out = h.generate(max_tokens=32)        # decode at depth 6 from the deep prefix
    """

    def __init__(self, model, prefix: PrefixCache):
        self.model, self.prefix = model, prefix

    @property
    def loops(self) -> int:
        return self.prefix.loops

    @property
    def logits(self) -> np.ndarray:
        return sharding.to_host(self.prefix.logits)

    def deeper(self, loops: int) -> "ResumeHandle":
        if check.loops(loops) < self.loops:
            raise ValueError(f"deeper(loops={loops}) is shallower than the handle's loops={self.loops}; "
                             "use handle.prefix.at_depth for shallower views")
        return ResumeHandle(self.model, self.prefix.at_depth(loops))

    def generate(self, max_tokens: int = 32, **kw) -> list[int]:
        return self.model.generate_from_prefix_cache(self.prefix, max_tokens=max_tokens, **kw)

    def __repr__(self) -> str:
        return f"ResumeHandle(len={len(self.prefix)}, loops={self.loops})"
