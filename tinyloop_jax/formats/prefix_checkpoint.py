"""Prefix checkpoints: a `PrefixCache`'s arrays, keyed by tree path, in a `checkpoint` folder.

    <path>/tinyloop.json   kind "prefix_cache"; model_fingerprint, kv_mode, loops, cache_window,
                           n_pre, n_post, prompt_len, layout, rings (the pre layers held as rings)
    <path>/arrays/         cache.{pre.j, loop, post.j}.<name>, cache.pos (, cache.ring_pos), cache.length, prompt,
                           logits, seen, depth_states (, state)

Plain functions over the prefix's fields: this module reads a prefix's attributes and returns
the fields of a loaded one, so it needs nothing from the API layer (`PrefixCache.save` / `.load`
call it).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..model import sharding
from ..model.cache import KVCache, first_passes
from . import checkpoint

KIND = "prefix_cache"
# 1 = one array per cache layer (before the pass axis), 2 = passes stacked, 3 = passes x loop
# blocks (2 reads as 3 with one loop block)
LAYOUT = 3


def save(path: str, prefix) -> None:
    """Write `prefix` (an `api.prefix.PrefixCache`, read by its fields: formats/ imports nothing
    from the API layer) to a new folder `path`, atomically. A view of a deeper prefix saves only
    the passes of its own depth (and no loop state)."""
    cache, states, state = prefix.cache, prefix.depth_states, prefix.state
    if cache.passes > prefix.loops:
        cache, states, state = first_passes(cache, prefix.loops), states[:len(cache.pre) + prefix.loops], None
    tree = dict(cache=dict(pre=list(cache.pre), loop=cache.loop, post=list(cache.post), pos=cache.pos,
                           length=cache.length, **({} if cache.ring_pos is None else dict(ring_pos=cache.ring_pos))),
                prompt=prefix.prompt, logits=prefix.logits, seen=prefix.seen, depth_states=states)
    if state is not None:
        tree["state"] = state
    meta = dict(model_fingerprint=prefix.model_fingerprint, loops=prefix.loops, cache_window=prefix.cache_window,
                kv_mode=cache.kv_mode.name, n_pre=len(cache.pre), n_post=len(cache.post), prompt_len=len(prefix.prompt),
                layout=LAYOUT, seed=prefix.seed, rings=list(cache.rings), kv_share=prefix.weights.config.kv_share)
    checkpoint.save(path, KIND, checkpoint.flatten(tree), meta)


def load(path: str, fingerprint: str, mesh=None, kv_share: str = "full") -> dict:
    """The fields of the prefix saved at `path` (every `PrefixCache` field but `weights`), for
    the model whose fingerprint is `fingerprint` (and `kv_share`); with `mesh`, the cache is
    placed on it. A prefix of another model (or mode, or kv_share) or an older layout is a
    ValueError; a damaged folder a RuntimeError or ValueError."""
    meta = checkpoint.read_meta(path, KIND)
    if meta.get("kv_share", "full") != kv_share:
        raise ValueError(f"{path} was built with kv_share={meta.get('kv_share', 'full')!r}, this model has "
                         f"kv_share={kv_share!r}")
    if meta["model_fingerprint"] != fingerprint:
        raise ValueError(f"{path} was built by a different model or kv_mode (fingerprint "
                         f"{meta['model_fingerprint'][:12]}…, this model {fingerprint[:12]}…)")
    if meta.get("layout") not in (2, LAYOUT):
        raise ValueError(f"{path} was saved by an older version (cache layout {meta.get('layout', 1)}, this "
                         f"version reads 2 and {LAYOUT}); rebuild the prefix")
    arrays, meta = checkpoint.load(path, KIND)

    def field(name: str) -> dict:  # the arrays under one tree path, keyed by the rest of their path
        return {k[len(name) + 1:]: jnp.asarray(a) for k, a in arrays.items() if k.startswith(name + ".")}

    loop = field("cache.loop")
    if meta["layout"] == 2:  # [passes, ...] -> [passes, 1 loop block, ...]
        loop = {n: a[:, None] for n, a in loop.items()}
    cache = KVCache(pre=tuple(field(f"cache.pre.{j}") for j in range(int(meta["n_pre"]))), loop=loop,
                    pos=jnp.asarray(arrays["cache.pos"]), length=jnp.asarray(arrays["cache.length"]),
                    kv_mode=meta["kv_mode"],
                    post=tuple(field(f"cache.post.{j}") for j in range(int(meta.get("n_post", 0)))),
                    ring_pos=jnp.asarray(arrays["cache.ring_pos"]) if meta.get("rings") else None,
                    rings=tuple(meta.get("rings", ())))
    if mesh is not None:  # saved from anywhere: placed on this model's mesh
        cache = sharding.place_cache(cache, mesh)
    prompt = arrays["prompt"].copy()
    if int(cache.length) != len(prompt) or int(meta["prompt_len"]) != len(prompt):
        raise RuntimeError(f"{path}: cache length {int(cache.length)} disagrees with prompt length {len(prompt)}")
    prompt.setflags(write=False)
    return dict(cache=cache, prompt=prompt, loops=int(meta["loops"]), cache_window=int(meta["cache_window"]),
                logits=jnp.asarray(arrays["logits"]), seen=jnp.asarray(arrays["seen"]),
                depth_states=jnp.asarray(arrays["depth_states"]),
                state=jnp.asarray(arrays["state"]) if "state" in arrays else None, seed=int(meta.get("seed", 0)))
