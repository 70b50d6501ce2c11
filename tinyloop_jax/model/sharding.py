"""Placement on a `('data', 'model')` mesh: Megatron-style tensor parallelism over `'model'`,
requests over `'data'`.

    weights   attention heads and MLP width split over 'model': the fused q|k|v projection viewed
              so that a device's slice holds whole heads (gpt2 [D, 3, H, hd]; llama
              [D, KV, G + 2, hd]: each KV head with its G query heads), output / down projections
              split by rows, gate|up viewed [D, 2, F]; norms, embeddings, head replicated; an MLP
              width 'model' does not divide is replicated
    caches    K/V split by KV heads over 'model' (h modes store h, which has no head axis:
              replicated); a batch of requests' own segments split over 'data'
    requests  N padded up to a multiple of 'data' with rows that finish at once

So each layer's attention and MLP end in one all-reduce over 'model' (two per layer), and no
weight moves between devices. `mesh_layout` / `single_layout` convert the fused weights between
the single-device layout (what checkpoints hold) and the mesh view.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import ModelConfig
from .params import BlockParams, LlamaBlock, Params

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

def _qkv_view(cfg: ModelConfig, w: jax.Array) -> jax.Array:
    """Fused q|k|v columns [..., (H + 2 KV) hd] -> a view whose head axis splits whole heads."""
    lead, hd = w.shape[:-1], cfg.head_dim
    if cfg.block == "gpt2":
        return w.reshape(*lead, 3, cfg.n_heads, hd)
    kv, g = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    q = w[..., :cfg.q_dim].reshape(*lead, kv, g, hd)
    k = w[..., cfg.q_dim:cfg.q_dim + cfg.kv_dim].reshape(*lead, kv, 1, hd)
    v = w[..., cfg.q_dim + cfg.kv_dim:].reshape(*lead, kv, 1, hd)
    return jnp.concatenate([q, k, v], axis=-2)  # [..., KV, G + 2, hd]


def _qkv_flat(cfg: ModelConfig, w: jax.Array) -> jax.Array:
    """Inverse of `_qkv_view`."""
    if cfg.block == "gpt2":
        return w.reshape(*w.shape[:-3], -1)
    lead, g = w.shape[:-3], cfg.n_heads // cfg.n_kv_heads
    parts = (w[..., :g, :], w[..., g:g + 1, :], w[..., g + 1:, :])
    return jnp.concatenate([x.reshape(*lead, -1) for x in parts], axis=-1)


def _map_blocks(params: Params, f) -> Params:
    return params.replace(pre=tuple(map(f, params.pre)), loop=tuple(map(f, params.loop)),
                          post=tuple(map(f, params.post)))


def _vocab_rows(cfg: ModelConfig, m: int) -> int:
    return -(-cfg.vocab_size // m) * m


def mesh_layout(params: Params, cfg: ModelConfig) -> Params:
    """Single-device weights -> the mesh view of the fused projections, the embedding and head
    padded with zero rows to a multiple of 'model' (split by vocabulary; the logits of the
    padding ids are cut off in `transformer.lm_head`)."""
    def blk(b):
        b = b.replace(w_qkv=_qkv_view(cfg, b.w_qkv),
                      b_qkv=None if b.b_qkv is None else _qkv_view(cfg, b.b_qkv))
        if isinstance(b, LlamaBlock):
            b = b.replace(w_gate_up=b.w_gate_up.reshape(b.w_gate_up.shape[0], 2, -1))
        return b
    pad = _vocab_rows(cfg, size(cfg.mesh, MODEL)) - cfg.vocab_size
    rows = lambda a: None if a is None else jnp.pad(a, ((0, pad), (0, 0)))  # noqa: E731
    return _map_blocks(params, blk).replace(wte=rows(params.wte), head=rows(params.head))


def single_layout(params: Params, cfg: ModelConfig) -> Params:
    """Inverse of `mesh_layout` (what checkpoints hold)."""
    def blk(b):
        b = b.replace(w_qkv=_qkv_flat(cfg, b.w_qkv), b_qkv=None if b.b_qkv is None else _qkv_flat(cfg, b.b_qkv))
        if isinstance(b, LlamaBlock):
            b = b.replace(w_gate_up=b.w_gate_up.reshape(b.w_gate_up.shape[0], -1))
        return b
    cut = lambda a: None if a is None else a[:cfg.vocab_size]  # noqa: E731
    return _map_blocks(params, blk).replace(wte=cut(params.wte), head=cut(params.head))


def param_specs(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """A PartitionSpec for every weight of a mesh-layout Params."""
    width = MODEL if cfg.intermediate_size % size(mesh, MODEL) == 0 else None  # else replicated

    def blk(b):
        rep = jax.tree.map(lambda a: P(), b)
        if isinstance(b, BlockParams):  # w_qkv [D, 3, H, hd]
            return rep.replace(w_qkv=P(None, None, MODEL), b_qkv=P(None, MODEL), w_o=P(MODEL), w_fc=P(None, width),
                               b_fc=P(width), w_proj=P(width))
        return rep.replace(w_qkv=P(None, MODEL), b_qkv=None if b.b_qkv is None else P(MODEL), w_o=P(MODEL),
                           w_gate_up=P(None, None, width), w_down=P(width))

    specs = jax.tree.map(lambda a: P(), params).replace(wte=P(MODEL), head=None if params.head is None else P(MODEL))
    return specs.replace(pre=tuple(map(blk, params.pre)), loop=tuple(map(blk, params.loop)),
                         post=tuple(map(blk, params.post)))


def place_params(params: Params, cfg: ModelConfig, mesh: Mesh) -> Params:
    """Single-device weights -> mesh-layout weights placed with `param_specs` (cfg.mesh = mesh)."""
    params = mesh_layout(params, cfg)
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
    return jax.jit(lambda: jnp.full(shape, fill, dtype), out_shardings=NamedSharding(mesh, spec))()


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
                         pos=put(cache.pos, None), length=put(cache.length, None))


def rows(mesh: Mesh | None, n: int) -> int:
    """N requests padded up to a multiple of 'data'."""
    d = size(mesh, DATA)
    return -(-n // d) * d
