"""Parameter pytrees (Flax `struct` dataclasses) and their random initialisation.

Layout follows GPT-2 (`x @ W + b`, weights stored `[in, out]`), so Hugging Face tensors map
one to one:

    wte [V, D]   wpe [S_max, D]          tied LM head: logits = ln_f(x) @ wte.T
    pre[i]: BlockParams                  i < n_pre_blocks, each run once
    loop:   BlockParams                  run `loops` times
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


@struct.dataclass
class BlockParams:
    ln1_g: jax.Array  # [D]
    ln1_b: jax.Array  # [D]
    w_qkv: jax.Array  # [D, 3D]  (q | k | v, heads contiguous inside each)
    b_qkv: jax.Array  # [3D]
    w_o: jax.Array  # [D, D]
    b_o: jax.Array  # [D]
    ln2_g: jax.Array  # [D]
    ln2_b: jax.Array  # [D]
    w_fc: jax.Array  # [D, F]
    b_fc: jax.Array  # [F]
    w_proj: jax.Array  # [F, D]
    b_proj: jax.Array  # [D]


@struct.dataclass
class Params:
    wte: jax.Array  # [V, D]
    wpe: jax.Array  # [S_max, D]
    pre: tuple  # tuple[BlockParams, ...], length n_pre_blocks
    loop: BlockParams
    lnf_g: jax.Array  # [D]
    lnf_b: jax.Array  # [D]


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
        """sha256 of the config (kv_mode included) and every weight."""
        return self.memo.get(lambda: fingerprint(self.params, self.config))


def fingerprint(params: Params, config: ModelConfig) -> str:
    cfg = json.dumps(config.to_dict(), sort_keys=True)
    return hashlib.sha256((cfg + params_digest(params)).encode()).hexdigest()


def _random_block(rng: np.random.Generator, d: int, f: int) -> BlockParams:
    # Large matrices (not GPT-2's 0.02): each block moves the residual stream more than the
    # embedding does, so a random model's greedy output is varied, not "repeat the input".
    std, proj_std = 2.0 / np.sqrt(d), 2.0 / np.sqrt(f)
    n = lambda shape, s: rng.normal(0.0, s, shape).astype(np.float32)  # noqa: E731
    # Biases and LayerNorm affine terms are small random values (not GPT-2's zeros) so that
    # tests exercise every term of the forward pass.
    return BlockParams(
        ln1_g=1.0 + n((d,), 0.1), ln1_b=n((d,), 0.02),
        w_qkv=n((d, 3 * d), std), b_qkv=n((3 * d,), 0.02),
        w_o=n((d, d), proj_std), b_o=n((d,), 0.02),
        ln2_g=1.0 + n((d,), 0.1), ln2_b=n((d,), 0.02),
        w_fc=n((d, f), std), b_fc=n((f,), 0.02),
        w_proj=n((f, d), proj_std), b_proj=n((d,), 0.02),
    )


def gpt2_init(config: ModelConfig, seed: int = 0) -> Params:
    """GPT-2's initialisation (std 0.02, scaled residual projections, zero biases): for training."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_model * config.mlp_ratio
    proj = 0.02 / np.sqrt(2 * (config.n_pre_blocks + config.default_loops))
    n = lambda *shape, s=0.02: rng.normal(0.0, s, shape).astype(np.float32)  # noqa: E731
    z, o = (lambda k: np.zeros((k,), np.float32)), (lambda k: np.ones((k,), np.float32))  # noqa: E731

    def blk():
        return BlockParams(ln1_g=o(d), ln1_b=z(d), w_qkv=n(d, 3 * d), b_qkv=z(3 * d), w_o=n(d, d, s=proj), b_o=z(d),
                           ln2_g=o(d), ln2_b=z(d), w_fc=n(d, f), b_fc=z(f), w_proj=n(f, d, s=proj), b_proj=z(d))

    tree = Params(wte=n(config.vocab_size, d), wpe=n(config.max_seq_len, d, s=0.01),
                  pre=tuple(blk() for _ in range(config.n_pre_blocks)), loop=blk(), lnf_g=o(d), lnf_b=z(d))
    return jax.tree.map(jnp.asarray, tree)


def random_params(config: ModelConfig, seed: int = 0) -> Params:
    """Seeded random weights for tests and benchmarks. The embedding is scaled so logits
    spread over ~unit range, which keeps greedy decoding away from near-ties."""
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.d_model * config.mlp_ratio
    tree = Params(
        wte=rng.normal(0.0, 1.0 / np.sqrt(d), (config.vocab_size, d)).astype(np.float32),
        wpe=rng.normal(0.0, 0.05, (config.max_seq_len, d)).astype(np.float32),
        pre=tuple(_random_block(rng, d, f) for _ in range(config.n_pre_blocks)),
        loop=_random_block(rng, d, f),
        lnf_g=np.ones((d,), np.float32),
        lnf_b=np.zeros((d,), np.float32),
    )
    return jax.tree.map(jnp.asarray, tree)


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every tensor (tuples in place of arrays)."""
    d, f, v, s = config.d_model, config.d_model * config.mlp_ratio, config.vocab_size, config.max_seq_len

    def blk():
        return BlockParams(ln1_g=(d,), ln1_b=(d,), w_qkv=(d, 3 * d), b_qkv=(3 * d,), w_o=(d, d), b_o=(d,),
                           ln2_g=(d,), ln2_b=(d,), w_fc=(d, f), b_fc=(f,), w_proj=(f, d), b_proj=(d,))

    return Params(wte=(v, d), wpe=(s, d), pre=tuple(blk() for _ in range(config.n_pre_blocks)), loop=blk(),
                  lnf_g=(d,), lnf_b=(d,))


def _is_shape(x) -> bool:
    """A shape in `param_shapes` (a non-empty tuple of ints; `pre` is an empty tuple without pre blocks)."""
    return isinstance(x, tuple) and len(x) > 0 and all(isinstance(i, int) for i in x)


def named_leaves(tree, is_leaf=None) -> dict:
    """{tree path: leaf} with paths like "pre.0.w_qkv" (what checkpoints are keyed by)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return {".".join(_key(k) for k in path): leaf for path, leaf in leaves}


def _key(k) -> str:
    return str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))))


def flatten(params: Params) -> dict:
    """{tree path: array} of a model's parameters (or of `param_shapes`' tuples)."""
    return named_leaves(params, is_leaf=_is_shape)


def unflatten(arrays: dict, config: ModelConfig) -> Params:
    """Inverse of `flatten` for a model of `config`; a missing tensor is a ValueError naming it."""
    template = param_shapes(config)
    names = list(flatten(template))
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ValueError(f"checkpoint lacks tensor {missing[0]}")
    treedef = jax.tree.structure(template, is_leaf=_is_shape)
    return jax.tree.unflatten(treedef, [arrays[n] for n in names])


def check_shapes(params: Params, config: ModelConfig) -> None:
    """Raise ValueError naming the first tensor whose shape disagrees with `config`."""
    if len(params.pre) != config.n_pre_blocks:
        raise ValueError(f"expected {config.n_pre_blocks} pre blocks, got {len(params.pre)}")
    want = flatten(param_shapes(config))
    for name, arr in flatten(params).items():
        if tuple(arr.shape) != want[name]:
            raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, expected {want[name]}")


def params_digest(params: Params) -> str:
    """sha256 over every parameter's bytes, in pytree order (for fingerprints)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype.str)).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
