"""`PrefixCache`: a prompt's KV state, held immutably and shared by any number of requests."""

from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import checkpoint
from .cache import KVCache


@dataclasses.dataclass(frozen=True, eq=False)
class PrefixCache:
    """The prefilled state of `prompt` at depth `loops`.

    Requests read `cache` and never write it (each writes its own segment), so one handle
    serves serial and concurrent calls unchanged. `logits` are the next-token logits after
    the last prompt token, so the first decoded token needs no re-run of the prompt.
    """

    cache: KVCache  # n_pre_blocks + loops layers, positions 0 .. len(prompt)-1
    prompt: np.ndarray  # [P] int32, read-only copy
    loops: int
    cache_window: int
    kv_mode: str
    logits: np.ndarray  # [V] float32, read-only
    model_fingerprint: str
    model_token: object = dataclasses.field(default=None, repr=False)  # identity of the building Model
    # The last prompt token's residual stream after each cache layer [n_layers, D] float32 (host,
    # read-only, like `logits`): the next-token logits of every shallower depth (`at_depth`).
    depth_states: np.ndarray | None = dataclasses.field(default=None, repr=False)
    # keep_state=True: every position's stream after the last loop iteration [T, D] (T = the
    # prompt's bucket), from which deeper iterations continue without re-running this depth.
    state: jax.Array | None = dataclasses.field(default=None, repr=False)
    model_ref: object = dataclasses.field(default=None, repr=False, compare=False)  # weakref to the Model

    def __len__(self) -> int:
        return int(self.prompt.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held on device: the cache buffers (K/V or their stored form, plus positions),
        and the kept loop state if any (host-side logits and depth states are not counted)."""
        return self.cache.nbytes + (0 if self.state is None else int(self.state.nbytes))

    @property
    def keeps_state(self) -> bool:
        return self.state is not None

    def at_depth(self, loops: int) -> "PrefixCache":
        """This prompt's prefix at another loop depth, without re-running what is done: for
        loops <= self.loops, the first layers (the K/V of iteration i do not depend on the total
        depth) and that depth's logits; deeper, only the missing iterations, from the kept state
        (`build_prefix_cache(..., keep_state=True)`). Otherwise a RuntimeError."""
        model = self.model_ref() if self.model_ref is not None else None
        if model is None:
            raise RuntimeError("at_depth needs the Model that built or loaded this prefix, and it is gone")
        return model._at_depth(self, loops)

    def __repr__(self) -> str:
        return (f"PrefixCache(len={len(self)}, loops={self.loops}, cache_window={self.cache_window}, "
                f"kv_mode={self.kv_mode!r}, capacity={self.cache.capacity}, nbytes={self.nbytes})")

    # ---- persistence -------------------------------------------------------------------------

    def save(self, path: str) -> None:
        """Write this prefix to a new folder `path` (orbax arrays + a JSON record with the model
        fingerprint, mode, loops and window). Atomic: a failed save leaves nothing behind."""
        arrays = checkpoint.flatten({"layers": [dict(e) for e in self.cache.layers]})
        arrays.update(pos=np.asarray(self.cache.pos), length=np.asarray(self.cache.length),
                      prompt=self.prompt, logits=self.logits)
        arrays.update({k: np.asarray(v) for k, v in (("depth_states", self.depth_states), ("state", self.state))
                       if v is not None})
        meta = dict(model_fingerprint=self.model_fingerprint, loops=self.loops,
                    cache_window=self.cache_window, kv_mode=self.kv_mode,
                    n_layers=self.cache.n_layers, prompt_len=len(self))
        checkpoint.save(path, "prefix_cache", arrays, meta)

    @classmethod
    def load(cls, path: str, model) -> "PrefixCache":
        """Load a prefix saved by `save` for use with `model`. A prefix of another model (or
        mode) is a ValueError; a damaged folder a RuntimeError or ValueError."""
        model._check_open()
        meta = checkpoint.read_meta(path, "prefix_cache")
        if meta["model_fingerprint"] != model.fingerprint:
            raise ValueError(f"{path} was built by a different model or kv_mode "
                             f"(fingerprint {meta['model_fingerprint'][:12]}…, this model "
                             f"{model.fingerprint[:12]}…)")
        arrays, meta = checkpoint.load(path, "prefix_cache")
        n_layers = int(meta["n_layers"])
        names = sorted({k.split(".")[2] for k in arrays if k.startswith("layers.")})
        layers = tuple({n: jnp.asarray(arrays[f"layers.{i}.{n}"]) for n in names} for i in range(n_layers))
        cache = KVCache(layers=layers, pos=jnp.asarray(arrays["pos"]),
                        length=jnp.asarray(arrays["length"]), kv_mode=meta["kv_mode"])
        prompt, logits = arrays["prompt"].copy(), arrays["logits"].copy()
        if int(cache.length) != len(prompt) or int(meta["prompt_len"]) != len(prompt):
            raise RuntimeError(f"{path}: cache length {int(cache.length)} disagrees with prompt length {len(prompt)}")
        prompt.setflags(write=False)
        logits.setflags(write=False)
        opt = dict(depth_states=arrays["depth_states"].copy() if "depth_states" in arrays else None,
                   state=jnp.asarray(arrays["state"]) if "state" in arrays else None)
        if opt["depth_states"] is not None:
            opt["depth_states"].setflags(write=False)
        return cls(cache=cache, prompt=prompt, loops=int(meta["loops"]), cache_window=int(meta["cache_window"]),
                   kv_mode=meta["kv_mode"], logits=logits, model_fingerprint=meta["model_fingerprint"],
                   model_token=model._token, model_ref=weakref.ref(model), **opt)


def tree_equal(a: KVCache, b: KVCache) -> bool:
    """Bit-identical caches (same structure, shapes, dtypes and bytes)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return (jax.tree.structure(a) == jax.tree.structure(b)
            and all(np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype for x, y in zip(la, lb)))
