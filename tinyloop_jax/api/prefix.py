"""`PrefixCache`: a prompt's KV state, held immutably and shared by any number of requests."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import checkpoint
from ..model import sharding
from . import validation as check
from ..model.cache import KVCache, first_passes
from ..model.params import Weights

# prefix checkpoints: 1 = one array per cache layer (before the pass axis), 2 = passes stacked,
# 3 = passes x loop blocks (2 reads as 3 with one loop block)
LAYOUT = 3


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
        Otherwise a RuntimeError. See `functional.prefix_at_depth`."""
        from .functional import prefix_at_depth  # the method is sugar over the pure function

        return prefix_at_depth(self, check.loops(loops))

    def __repr__(self) -> str:
        return (f"PrefixCache(len={len(self)}, loops={self.loops}, cache_window={self.cache_window}, "
                f"kv_mode={self.kv_mode!r}, capacity={self.cache.capacity}, nbytes={self.nbytes})")

    # ---- persistence -------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write this prefix to a new folder `path` (orbax arrays keyed by tree path + a JSON
        record with the model fingerprint, mode, loops and window). Atomic: a failed save
        leaves nothing behind."""
        cache, states, state = self.cache, self.depth_states, self.state
        if cache.passes > self.loops:  # a view: save only the depth it serves
            cache, states, state = first_passes(cache, self.loops), states[:len(cache.pre) + self.loops], None
        tree = dict(cache=dict(pre=list(cache.pre), loop=cache.loop, post=list(cache.post), pos=cache.pos,
                               length=cache.length),
                    prompt=self.prompt, logits=self.logits, seen=self.seen, depth_states=states)
        if state is not None:
            tree["state"] = state
        meta = dict(model_fingerprint=self.model_fingerprint, loops=self.loops, cache_window=self.cache_window,
                    kv_mode=self.kv_mode, n_pre=len(cache.pre), n_post=len(cache.post), prompt_len=len(self),
                    layout=LAYOUT)
        checkpoint.save(path, "prefix_cache", checkpoint.flatten(tree), meta)

    @classmethod
    def load(cls, path: str, model) -> "PrefixCache":
        """Load a prefix saved by `save` for use with `model`. A prefix of another model (or
        mode) is a ValueError; a damaged folder a RuntimeError or ValueError."""
        weights = model.weights
        meta = checkpoint.read_meta(path, "prefix_cache")
        if meta["model_fingerprint"] != weights.fingerprint:
            raise ValueError(f"{path} was built by a different model or kv_mode "
                             f"(fingerprint {meta['model_fingerprint'][:12]}…, this model "
                             f"{weights.fingerprint[:12]}…)")
        if meta.get("layout") not in (2, LAYOUT):
            raise ValueError(f"{path} was saved by an older version (cache layout {meta.get('layout', 1)}, this "
                             f"version reads 2 and {LAYOUT}); rebuild the prefix")
        arrays, meta = checkpoint.load(path, "prefix_cache")
        field = lambda name: {k[len(name) + 1:]: a for k, a in arrays.items() if k.startswith(name + ".")}  # noqa: E731
        pre = [field(f"cache.pre.{j}") for j in range(int(meta["n_pre"]))]
        cache = KVCache(pre=tuple({n: jnp.asarray(a) for n, a in e.items()} for e in pre),
                        loop={n: jnp.asarray(a if meta["layout"] == LAYOUT else a[:, None])
                              for n, a in field("cache.loop").items()},
                        pos=jnp.asarray(arrays["cache.pos"]), length=jnp.asarray(arrays["cache.length"]),
                        kv_mode=meta["kv_mode"],
                        post=tuple({n: jnp.asarray(a) for n, a in field(f"cache.post.{j}").items()}
                                   for j in range(int(meta.get("n_post", 0)))))
        if weights.config.mesh is not None:  # saved from anywhere: placed on this model's mesh
            cache = sharding.place_cache(cache, weights.config.mesh)
        prompt = arrays["prompt"].copy()
        if int(cache.length) != len(prompt) or int(meta["prompt_len"]) != len(prompt):
            raise RuntimeError(f"{path}: cache length {int(cache.length)} disagrees with prompt length {len(prompt)}")
        prompt.setflags(write=False)
        return cls(cache=cache, prompt=prompt, loops=int(meta["loops"]), cache_window=int(meta["cache_window"]),
                   logits=jnp.asarray(arrays["logits"]), seen=jnp.asarray(arrays["seen"]),
                   depth_states=jnp.asarray(arrays["depth_states"]), weights=weights,
                   state=jnp.asarray(arrays["state"]) if "state" in arrays else None)


def tree_equal(a, b) -> bool:
    """Bit-identical pytrees (same structure, shapes, dtypes and bytes)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype for x, y in zip(la, lb)))
