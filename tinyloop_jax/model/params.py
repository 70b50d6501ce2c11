"""Parameter pytrees (Flax `struct` dataclasses) and their random initialisation.

Weights are stored `[in, out]` (`x @ W + b`, GPT-2's layout; Llama's `nn.Linear` weights are
transposed on import):

    wte [V, D]   wpe [S_max, D] (gpt2)       head [V, D] or None: logits = norm(x) @ (head or wte).T
    pre[i]:  BlockParams | LlamaBlock         i < n_pre_blocks, each run once
    loop[j]: BlockParams | LlamaBlock         j < loop_blocks: the stack run `loops` times
    post[i]: BlockParams | LlamaBlock         i < n_post_blocks: the coda, each run once
    lnf_g, lnf_b [D] (b: LayerNorm only)     the final norm
    gate_w [D], gate_b []                     Ouro's early-exit gate (when the model has one)
    adapter [2D, D]                           Huginn's pass input: concat(state, pre output) @ adapter

The fused projections are head-shaped, so that a slice along a head axis holds whole heads
(a mesh only places them, see `sharding`):

    gpt2   w_qkv [D, 3, H, hd] (q | k | v)         b_qkv [3, H, hd]
    llama  w_qkv [D, KV, G + 2, hd]                b_qkv [KV, G + 2, hd]   (G = H / KV: each KV
           head's G query heads, then its k and v)  w_gate_up [D, 2, F] (gate | up)

Checkpoints record this as weight layout `LAYOUT` = 2. Layout 1 (before it) held them flat
(w_qkv [D, (H + 2 KV) hd] as q | k | v, w_gate_up [D, 2F]) and is converted on load
(`from_flat_layout`); fingerprints hash layout 1 (`to_flat_layout`), so they do not change.
"""

from __future__ import annotations

import hashlib
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig
from . import qarray
from . import qpack
from .qarray import Fused, QuantArray, is_fused, is_quant
from .stack import is_stacked, unstacked

LAYOUT = 2  # the weight layout checkpoints record (1: flat fused projections, converted on load)


@struct.dataclass
class BlockParams:
    ln1_g: jax.Array  # [D]
    ln1_b: jax.Array  # [D]
    w_qkv: jax.Array  # [D, 3, H, hd]  (q | k | v)
    b_qkv: jax.Array  # [3, H, hd]
    w_o: jax.Array  # [D, D]
    b_o: jax.Array  # [D]
    ln2_g: jax.Array  # [D]
    ln2_b: jax.Array  # [D]
    w_fc: jax.Array  # [D, F]
    b_fc: jax.Array  # [F]
    w_proj: jax.Array  # [F, D]
    b_proj: jax.Array  # [D]


@struct.dataclass
class LlamaBlock:
    """A Llama-family block: RMSNorm weights, fused q|k|v grouped by KV head (each KV head's G
    query heads, then its k and v), fused gate|up. `attn_out_norm` / `mlp_out_norm`: the
    sandwich's output norms."""
    attn_norm: jax.Array  # [D]
    w_qkv: jax.Array  # [D, KV, G + 2, hd]
    w_o: jax.Array  # [H hd, D]
    mlp_norm: jax.Array  # [D]
    w_gate_up: jax.Array  # [D, 2, F]
    w_down: jax.Array  # [F, D]
    b_qkv: jax.Array | None = None  # [KV, G + 2, hd] with attention_bias
    attn_out_norm: jax.Array | None = None  # [D] sandwich
    mlp_out_norm: jax.Array | None = None  # [D] sandwich
    q_norm: jax.Array | None = None  # [hd] qk_norm (Gemma 3): each head's q normed before RoPE
    k_norm: jax.Array | None = None  # [hd]
    # static, from the config (`with_layers`): this block's own sliding window (0: none) and its
    # RoPE base (0: the model's), so every attention path sees them with the block's weights
    window: int = struct.field(pytree_node=False, default=0)
    rope_theta: float = struct.field(pytree_node=False, default=0.0)


@struct.dataclass
class Params:
    wte: jax.Array  # [V, D]
    wpe: jax.Array | None  # [S_max, D] (gpt2), None (llama: RoPE)
    pre: tuple  # tuple[block, ...], length n_pre_blocks
    loop: tuple  # tuple[block, ...], length loop_blocks
    lnf_g: jax.Array  # [D]
    lnf_b: jax.Array | None  # [D] (LayerNorm), None (RMSNorm)
    head: jax.Array | None = None  # [V, D] untied LM head
    gate_w: jax.Array | None = None  # [D] early-exit gate
    gate_b: jax.Array | None = None  # [] early-exit gate
    post: tuple = ()  # tuple[block, ...], length n_post_blocks: the coda, run once after the loop
    adapter: jax.Array | None = None  # [2D, D] injection="concat_adapter": rows [:D] read the state, [D:] e


class FingerprintMemo:
    """Holds a model's fingerprint once computed: it hashes every weight, so it is computed only
    where it is compared or saved, and then shared by the model and the prefixes it builds."""

    def __init__(self):
        self._value: str | None = None
        self._lock = threading.Lock()

    def get(self, compute) -> str:
        with self._lock:
            if self._value is None:
                self._value = compute()
            return self._value


@struct.dataclass
class Weights:
    """Parameters plus their (static) config: the input of the pure functions in
    `tinyloop_jax.functional`. Make one with `Weights.create`."""

    params: Params
    config: ModelConfig = struct.field(pytree_node=False)
    memo: FingerprintMemo = struct.field(pytree_node=False)

    @classmethod
    def create(cls, params: Params, config: ModelConfig) -> "Weights":
        return cls(params=params, config=config, memo=FingerprintMemo())

    @property
    def fingerprint(self) -> str:
        """sha256 of the config (kv_mode included) and every weight (see `fingerprint`)."""
        return self.memo.get(lambda: fingerprint(self.params, self.config))


def fingerprint(params: Params, config: ModelConfig) -> str:
    """sha256 of the config's description and `params_digest`: the same for a model on a mesh
    and on one device, and for either weight layout."""
    cfg = json.dumps(config.to_dict(), sort_keys=True)
    return hashlib.sha256((cfg + params_digest(params, config)).encode()).hexdigest()


# ---- the fused projections' layout --------------------------------------------------------------

def _xp(a):
    """numpy for host arrays (checkpoints, fingerprints), jax.numpy for device arrays (imports)."""
    return jnp if isinstance(a, jax.Array) else np


def fuse_qkv(q, k, v, config: ModelConfig):
    """Separate projections q [..., H hd], k, v [..., KV hd] (weights with a leading D, or
    biases) -> the fused head-shaped w_qkv / b_qkv: gpt2 [..., 3, H, hd]; llama
    [..., KV, G + 2, hd], each KV head's G query heads, then its k and v.

    >>> c = ModelConfig(vocab_size=8, d_model=4, n_heads=2, block="llama", n_kv_heads=1)
    >>> fuse_qkv(np.zeros((4, 4)), np.ones((4, 2)), np.ones((4, 2)), c).shape
    (4, 1, 4, 2)
    """
    xp, lead, hd = _xp(q), q.shape[:-1], config.head_dim
    if config.block == "gpt2":
        return xp.stack([a.reshape(*lead, config.n_heads, hd) for a in (q, k, v)], axis=-3)
    kv = config.n_kv_heads
    return xp.concatenate([q.reshape(*lead, kv, config.n_heads // kv, hd), k.reshape(*lead, kv, 1, hd),
                           v.reshape(*lead, kv, 1, hd)], axis=-2)


def _flat_width(field: str, config: ModelConfig) -> int | None:
    """The last axis of a fused tensor in layout 1 (None: not a fused tensor)."""
    if field in ("w_qkv", "b_qkv"):
        return config.q_dim + 2 * config.kv_dim
    if field == "w_gate_up":
        return 2 * config.intermediate_size
    return None


def from_flat_layout(name: str, a, config: ModelConfig):
    """One tensor named by its tree path (or field) in layout 1 -> this layout: the fused
    projections get their head axes (w_qkv, b_qkv: see `fuse_qkv`; w_gate_up [D, 2F] ->
    [D, 2, F]); every other tensor is returned as it is."""
    field = name.rsplit(".", 1)[-1]
    width = _flat_width(field, config)
    if width is None:
        return a
    if a.shape[-1] != width:
        raise ValueError(f"tensor {name} has shape {tuple(a.shape)}; the config implies a last axis of {width}")
    if field == "w_gate_up":
        return a.reshape(*a.shape[:-1], 2, config.intermediate_size)
    qd, kd = config.q_dim, config.kv_dim
    return fuse_qkv(a[..., :qd], a[..., qd:qd + kd], a[..., qd + kd:], config)


def to_flat_layout(name: str, a, config: ModelConfig):
    """Inverse of `from_flat_layout` (what fingerprints hash)."""
    field = name.rsplit(".", 1)[-1]
    if _flat_width(field, config) is None:
        return a
    if field == "w_gate_up" or config.block == "gpt2":  # row-major: only the shape changes
        return a.reshape(*a.shape[:-2 if field == "w_gate_up" else -3], -1)
    lead, g = a.shape[:-3], config.n_heads // config.n_kv_heads
    parts = (a[..., :g, :], a[..., g:g + 1, :], a[..., g + 1:, :])  # q, k, v of every KV head
    return _xp(a).concatenate([p.reshape(*lead, -1) for p in parts], axis=-1)


def from_flat(params: Params, config: ModelConfig) -> Params:
    """Every tensor through `from_flat_layout` (random weights are drawn flat, as before the
    head-shaped layout: the same seed gives the same model and fingerprint)."""
    return jax.tree_util.tree_map_with_path(lambda path, a: from_flat_layout(_key(path[-1]), a, config), params)


def cast(params: Params, config: ModelConfig) -> Params:
    """Weights in the config's dtype (packed weights stay packed)."""
    dt = config.compute_dtype
    return jax.tree.map(lambda a: a if is_quant(a) or a.dtype == dt else a.astype(dt), params, is_leaf=is_quant)


MATRICES = ("w_qkv", "w_o", "w_gate_up", "w_down", "w_fc", "w_proj")  # the blocks' matmul weights
WEIGHT_MODES = (None, "float", "int8", "int4")


def check_weight_mode(mode):
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown quantize_weights {mode!r}; valid: None, 'float', 'int8', 'int4'")
    return mode


def quantize_params(params: Params, config: ModelConfig, mode: str | None) -> Params:
    """`quantize_weights=`: None keeps every weight as it is (packed or float); "float"
    dequantizes packed weights to the model's dtype; "int8" / "int4" (re)quantize the blocks'
    matmul weights and the embedding / head to q8_0 / q4_0 (`qpack.quantize`, from float32).
    Norms, biases, position embeddings, gates and Huginn's adapter stay float."""
    if check_weight_mode(mode) is None:
        return params
    dt = config.compute_dtype

    def one(path, a):
        name = ".".join(_key(k) for k in path)
        if mode == "float":
            return qarray.dense(a, dt) if is_quant(a) or is_fused(a) else a
        if name.rsplit(".", 1)[-1] not in MATRICES and name not in ("wte", "head"):
            return a
        w, fmt = np.asarray(qarray.dense(a, jnp.float32)), qarray.QUANTIZE[mode]
        try:
            if name in ("wte", "head"):  # [V, D], contracted over D
                return qpack.quantize(w, fmt, transposed=True)
            return qarray.reshape_out(qpack.quantize(w.reshape(w.shape[0], -1), fmt), *w.shape[1:])
        except ValueError as e:
            raise ValueError(f"quantize_weights={mode!r}: tensor {name} {tuple(w.shape)}: {e}") from None
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda a: is_quant(a) or is_fused(a))


def nbytes(params: Params) -> int:
    """Bytes of every weight as held (packed weights at their packed size)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(params, is_leaf=is_quant))


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every tensor (`Shape` tuples in place of arrays; None where the model has none)."""
    c, S = config, (lambda *dims: Shape(dims))
    d, f, v = c.d_model, c.intermediate_size, c.vocab_size
    llama, sw = c.block == "llama", c.out_norms
    hd, kv = c.head_dim, c.n_kv_heads

    def blk():
        if llama:
            qkv = (kv, c.n_heads // kv + 2, hd)
            return LlamaBlock(attn_norm=S(d), w_qkv=S(d, *qkv), w_o=S(c.q_dim, d), mlp_norm=S(d), w_gate_up=S(d, 2, f),
                              w_down=S(f, d), b_qkv=S(*qkv) if c.attention_bias else None,
                              attn_out_norm=S(d) if sw else None, mlp_out_norm=S(d) if sw else None,
                              q_norm=S(hd) if c.qk_norm else None, k_norm=S(hd) if c.qk_norm else None)
        qkv = (3, c.n_heads, hd)
        return BlockParams(ln1_g=S(d), ln1_b=S(d), w_qkv=S(d, *qkv), b_qkv=S(*qkv), w_o=S(d, d), b_o=S(d),
                           ln2_g=S(d), ln2_b=S(d), w_fc=S(d, f), b_fc=S(f), w_proj=S(f, d), b_proj=S(d))

    return with_layers(Params(wte=S(v, d), wpe=None if llama else S(c.max_seq_len, d),
                              pre=tuple(blk() for _ in range(c.n_pre_blocks)),
                              loop=tuple(blk() for _ in range(c.loop_blocks)),
                              lnf_g=S(d), lnf_b=None if llama else S(d), head=None if c.tie_embeddings else S(v, d),
                              gate_w=S(d) if c.early_exit_gate else None, gate_b=S() if c.early_exit_gate else None,
                              post=tuple(blk() for _ in range(c.n_post_blocks)),
                              adapter=S(2 * d, d) if c.injection != "none" else None), c)


def with_layers(params: Params, config: ModelConfig) -> Params:
    """Each llama block with its static window and RoPE base from the config
    (`ModelConfig.block_window` / `block_theta`, distinct blocks numbered pre, loop, coda)."""
    if config.block != "llama":
        return params
    n_pre, k = len(params.pre), len(params.loop)

    def one(i, b):
        w, theta = config.block_window(i), config.block_theta(i)
        return b.replace(window=w, rope_theta=0.0 if theta == config.rope_theta else theta)
    return params.replace(pre=tuple(one(i, b) for i, b in enumerate(params.pre)),
                          loop=tuple(one(n_pre + j, b) for j, b in enumerate(params.loop)),
                          post=tuple(one(n_pre + k + j, b) for j, b in enumerate(params.post)))


class Shape(tuple):
    """A tensor's shape in `param_shapes` (a distinct type: `pre` is an empty tuple without pre
    blocks, and a scalar's shape is ())."""


def _is_shape(x) -> bool:
    return isinstance(x, (Shape, QuantArray, Fused))


def named_leaves(tree, is_leaf=None) -> dict:
    """{tree path: leaf} with paths like "pre.0.w_qkv" (what checkpoints are keyed by)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {".".join(_key(k) for k in path): leaf for path, leaf in leaves}


def _key(k) -> str:
    return str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))))


def flatten(params: Params) -> dict:
    """{tree path: array} of a model's parameters (or of `param_shapes`' tuples); a packed
    weight is one entry (a `QuantArray`); stacked layers (`stack.Stacked`) one entry a layer."""
    if is_stacked(params.pre):
        params = params.replace(pre=unstacked(params.pre))
    return named_leaves(params, is_leaf=_is_shape)


def unflatten(arrays: dict, config: ModelConfig) -> Params:
    """Inverse of `flatten` for a model of `config`; a missing tensor is a ValueError naming it."""
    template = param_shapes(config)
    names = list(flatten(template))
    # Checkpoints from before loop stacks (one loop block) name its tensors "loop.<field>".
    arrays = {("loop.0." + n[5:] if n.startswith("loop.") and not n[5].isdigit() else n): a
              for n, a in arrays.items()}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(f"checkpoint lacks tensor {missing[0]}")
    treedef = jax.tree.structure(template, is_leaf=_is_shape)
    return jax.tree.unflatten(treedef, [arrays[n] for n in names])


def check_shapes(params: Params, config: ModelConfig) -> None:
    """Raise ValueError naming the first tensor whose shape disagrees with `config`."""
    if len(params.pre) != config.n_pre_blocks:
        raise ValueError(f"expected {config.n_pre_blocks} pre blocks, got {len(params.pre)}")
    if len(params.loop) != config.loop_blocks:
        raise ValueError(f"expected {config.loop_blocks} loop blocks, got {len(params.loop)}")
    if len(params.post) != config.n_post_blocks:
        raise ValueError(f"expected {config.n_post_blocks} coda blocks, got {len(params.post)}")
    want, have = flatten(param_shapes(config)), flatten(params)
    for name in want.keys() ^ have.keys():
        raise ValueError(f"tensor {name} is {'missing' if name in want else 'not part of this config'}")
    for name, arr in have.items():
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, expected {want[name]}")


def host_leaves(params: Params, config: ModelConfig):
    """(tree path, numpy array) of every tensor in pytree order, one at a time (a model never has
    a second full copy on the host), without a mesh's padding of the embedding and head rows
    past `vocab_size` (see `sharding.place_params`): the weights as checkpoints hold them."""
    for name, leaf in flatten(params).items():
        # packed: its fields, as name.q / name.scale / name.min, in GGUF's order; a Fused weight's
        # parts as name.<i>.q ...
        packed = [(name, leaf)] if is_quant(leaf) else [(f"{name}.{i}", p) for i, p in enumerate(leaf.parts)] \
            if is_fused(leaf) else []
        for part, w in packed:
            w = qarray.canonical(w)
            for field in ("q", "scale", "min"):
                a = getattr(w, field)
                if a is not None:
                    a = np.asarray(a)
                    yield f"{part}.{field}", a[..., :config.vocab_size] if name in ("wte", "head") else a
        if packed:
            continue
        a = np.asarray(leaf)
        yield name, a[:config.vocab_size] if name in ("wte", "head") else a


def quant_formats(params: Params) -> dict:
    """{tree path: [format, transposed]} of the packed weights (what a checkpoint records); a
    `Fused` one: ["fused", [[format, transposed] of each part], its column order, its output axes]."""
    out = {}
    for n, a in flatten(params).items():
        if is_quant(a):
            out[n] = [a.fmt, a.transposed]
        elif is_fused(a):
            out[n] = ["fused", [[p.fmt, p.transposed] for p in a.parts], list(a.order), list(a.out)]
    return out


def pack_arrays(arrays: dict, formats: dict) -> dict:
    """Inverse of `host_leaves`' split: name.q / name.scale / name.min -> one QuantArray."""
    arrays = dict(arrays)

    def one(name, fmt, transposed):
        q, scale, mn = (arrays.pop(f"{name}.{f}", None) for f in ("q", "scale", "min"))
        if q is None or scale is None or fmt not in qarray.FORMATS or qarray.has_min(fmt) != (mn is not None):
            raise ValueError(f"checkpoint lacks the packed fields of tensor {name} ({fmt})")
        return QuantArray(q=jnp.asarray(q), scale=jnp.asarray(scale), min=None if mn is None else jnp.asarray(mn),
                          fmt=fmt, transposed=bool(transposed))
    for name, entry in formats.items():
        if entry[0] == "fused":
            _, parts, order, out = entry
            arrays[name] = Fused(parts=tuple(one(f"{name}.{i}", *p) for i, p in enumerate(parts)),
                                 order=tuple(int(c) for c in order), out=tuple(int(n) for n in out))
        else:
            arrays[name] = one(name, *entry)
    return arrays


def params_digest(params: Params, config: ModelConfig) -> str:
    """sha256 over every tensor's shape, dtype and bytes in pytree order, each in the flat
    layout 1 (`to_flat_layout`), so digests recorded before the head-shaped layout still hold."""
    h = hashlib.sha256()
    for name, a in host_leaves(params, config):
        a = to_flat_layout(name, a, config)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
