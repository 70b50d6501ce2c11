"""Placement on a `('data', 'model')` mesh: Megatron-style tensor parallelism over `'model'`,
requests over `'data'`.

    weights   attention heads and MLP width split over 'model': the fused q|k|v projection by
              its head axis, so a device's slice holds whole heads (gpt2 [D, 3, H, hd];
              llama [D, KV, G + 2, hd]: each KV head with its G query heads; see `params`),
              output / down projections by rows, gate|up [D, 2, F] by F; embedding and head
              by vocabulary (padded to a multiple of 'model'); norms replicated; an MLP width
              'model' does not divide is replicated
    caches    K/V split by KV heads over 'model' (h modes store h, which has no head axis:
              replicated); a batch of requests' own segments split over 'data'
    requests  N padded up to a multiple of 'data' with rows that finish at once

So each layer's attention and MLP end in one all-reduce over 'model' (two per layer), and no
weight moves between devices. The weights are stored in this layout from import on: placing
them changes no shape but the vocabulary padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import qarray
from .config import ModelConfig
from .params import BlockParams, Params

DATA, MODEL = "data", "model"


def make_mesh(data: int, model: int) -> Mesh:
    """A ('data', 'model') mesh over the first data * model devices (Auto axes)."""
    from jax.sharding import AxisType

    return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(AxisType.Auto,) * 2)


def size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])


def check(mesh: Mesh, cfg: ModelConfig) -> None:
    """ValueError unless `mesh` has axes ('data', 'model') and 'model' divides the KV heads."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != (DATA, MODEL):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model'), got {mesh!r}")
    m = size(mesh, MODEL)
    if cfg.n_kv_heads % m:
        raise ValueError(f"the mesh's 'model' axis ({m} devices) does not divide the model's "
                         f"{cfg.n_kv_heads} key/value heads")


# ---- weights ---------------------------------------------------------------------------------

def pad_vocab(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """The embedding and head with zero rows up to a multiple of 'model', so that they split by
    vocabulary (the logits of the padding ids are cut off in `transformer.lm_head`; checkpoints
    and fingerprints leave the padding out, see `params.host_leaves`)."""
    pad = -cfg.vocab_size % size(mesh, MODEL)

    def rows(a):
        if a is None or pad == 0:
            return a
        return qarray.pad_out(a, pad) if qarray.is_quant(a) else jnp.pad(a, ((0, pad), (0, 0)))
    return params.replace(wte=rows(params.wte), head=rows(params.head))


def param_specs(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """A PartitionSpec for every weight (heads and MLP width over 'model', see the module doc)."""
    width = MODEL if cfg.intermediate_size % size(mesh, MODEL) == 0 else None  # else replicated

    def blk(b):
        rep = jax.tree.map(lambda a: P(), b)
        if isinstance(b, BlockParams):  # w_qkv [D, 3, H, hd]
            return rep.replace(w_qkv=P(None, None, MODEL), b_qkv=P(None, MODEL), w_o=P(MODEL), w_fc=P(None, width),
                               b_fc=P(width), w_proj=P(width))
        # w_qkv [D, KV, G + 2, hd], w_gate_up [D, 2, F]
        return rep.replace(w_qkv=P(None, MODEL), b_qkv=None if b.b_qkv is None else P(MODEL), w_o=P(MODEL),
                           w_gate_up=P(None, None, width), w_down=P(width))

    specs = jax.tree.map(lambda a: P(), params).replace(wte=P(MODEL), head=None if params.head is None else P(MODEL))
    specs = specs.replace(pre=tuple(map(blk, params.pre)), loop=tuple(map(blk, params.loop)),
                          post=tuple(map(blk, params.post)))
    sizes = dict(mesh.shape)  # packed weights: their fields' specs from the logical one (`qarray.specs`)

    def packed(w, s):
        if qarray.is_fused(w):  # parts in different formats: replicated
            return jax.tree.map(lambda a: P(), w)
        return qarray.specs(w, s, sizes) if qarray.is_quant(w) and isinstance(s, P) else s
    return jax.tree.map(packed, params, specs, is_leaf=lambda a: qarray.is_quant(a) or qarray.is_fused(a))


def place_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Weights placed on `mesh` with `param_specs`, the vocabulary padded (`pad_vocab`)."""
    params = pad_vocab(params, cfg, mesh)
    specs = param_specs(params, cfg, mesh)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)


# ---- caches and requests ---------------------------------------------------------------------

def cache_spec(shape: tuple, batched: bool, head_axis: int | None, mesh: Mesh) -> P:
    """Spec of one cache array: axis 0 over 'data' when batched (and divisible), the KV-head
    axis `head_axis` over 'model' (None: no head axis, e.g. h modes' stored h)."""
    spec = [None] * len(shape)
    if batched and shape[0] % size(mesh, DATA) == 0:
        spec[0] = DATA
    if head_axis is not None and shape[head_axis] % size(mesh, MODEL) == 0:
        spec[head_axis] = MODEL
    return P(*spec)


def zeros(shape: tuple, dtype, spec: P, mesh: Mesh | None, fill=0) -> jax.Array:
    """An array allocated directly in its shards (no full copy on one device first)."""
    if mesh is None:
        return jnp.full(shape, fill, dtype)
    return _filler(tuple(shape), np.dtype(dtype), fill, NamedSharding(mesh, spec))()


@functools.lru_cache(maxsize=512)
def _filler(shape: tuple, dtype: np.dtype, fill, out: NamedSharding):
    """One jitted allocator per (shape, dtype, fill, sharding), kept: a fresh `jax.jit` of a
    lambda per call traced and lowered again on every allocation (every cache array of every
    call on a mesh)."""
    return jax.jit(functools.partial(jnp.full, shape, fill, dtype), out_shardings=out)


def to_host(x, dtype=None):
    """A device array as numpy at the host edge; an array spread over several processes is
    gathered from all of them first (every process calls this, in the same order)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, dtype)


def share(x):
    """Process 0's value of x (a numpy array) on every process: what process 0 admits is what
    every process runs (one process: x itself)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(x)))


def place_cache(cache, mesh: Mesh):
    """An unbatched segment (a loaded prefix) placed on `mesh`: K/V split by heads over 'model'."""
    heads = cache.kv_mode.splits_heads

    def put(a, head_axis):
        spec = cache_spec(a.shape, False, head_axis if heads else None, mesh)
        return jax.device_put(a, NamedSharding(mesh, spec))
    layer = lambda e: {n: put(a, 0) for n, a in e.items()}  # noqa: E731
    return cache.replace(pre=tuple(map(layer, cache.pre)), post=tuple(map(layer, cache.post)),
                         loop={n: put(a, 2) for n, a in cache.loop.items()},
                         pos=put(cache.pos, None), length=put(cache.length, None),
                         ring_pos=None if cache.ring_pos is None else put(cache.ring_pos, None))


def rows(mesh: Mesh | None, n: int) -> int:
    """N requests padded up to a multiple of 'data'."""
    d = size(mesh, DATA)
    return -(-n // d) * d
