"""The block math, as pure functions of one block's weights: norms, activations, RoPE (rotate-half
and Huginn's adjacent pairs), the fused q/k/v projection, K/V rebuilt from a stored h, and the
attention output's residual update and MLP (GPT-2 and Llama-family blocks, Ouro's sandwich norms,
Huginn's normed residuals, Gemma's q/k norms and local windows).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import qarray
from .config import ModelConfig
from .kv_modes import KVMode
from .params import Params


def layer_norm(x: jax.Array, g: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * g + b


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm: normalized in float32, cast back, then scaled (as the reference does)."""
    xf = x.astype(jnp.float32)
    return w * (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def final_norm(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    if cfg.block == "llama":
        return rms_norm(x, params.lnf_g, cfg.layer_norm_eps)
    return layer_norm(x, params.lnf_g, params.lnf_b, cfg.layer_norm_eps)


def gelu(x: jax.Array) -> jax.Array:
    """GPT-2's tanh approximation ("gelu_new")."""
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half pairing (channel i with i + hd/2): x [.., T, hd] at
    positions pos [T]. Angles in float32, as Hugging Face computes them."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    freqs = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(freqs).astype(x.dtype), jnp.sin(freqs).astype(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rope_adjacent(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, adjacent pairing (channel 2i with 2i + 1, Huginn's "complex" form): x
    [.., T, hd] at positions pos [T]. Rotated in float32 and cast back, as the reference does."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    freqs = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, hd/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], hd // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def rotate(x: jax.Array, pos: jax.Array, cfg: ModelConfig, blk=None) -> jax.Array:
    """q or k [.., T, hd] of a llama block rotated at pos [T] by the model's pairing, with the
    block's RoPE base (`LlamaBlock.rope_theta`; 0 or no block: the model's)."""
    theta = getattr(blk, "rope_theta", 0.0) or cfg.rope_theta
    if cfg.rope_pairing == "adjacent":
        return rope_adjacent(x, pos, theta)
    return rope(x, pos, theta)


def layer_window(window, blk):
    """The window a block attends over: the call's `window` (cache_window; a traced array in
    the paged engine) and the block's own (`LlamaBlock.window`, Gemma's local layers), the
    smaller where both are set (0: none)."""
    own = getattr(blk, "window", 0)
    if not own:
        return window
    if isinstance(window, int):
        return own if window == 0 else min(window, own)
    return jnp.where(window == 0, own, jnp.minimum(window, own))


def _project(h: jax.Array, w, b: jax.Array | None) -> jax.Array:
    """h [T, D] @ w [D, ...] (+ b [...]): a fused, head-shaped projection -> [T, ...]."""
    y = qarray.matmul(h, w)
    return y if b is None else y + b


def qkv_heads(x: jax.Array, blk, cfg: ModelConfig, q_pos: jax.Array):
    """x [T, D] at positions q_pos [T] -> h [T, D] (the normalized input), q [H, T, hd],
    k, v [KV, T, hd] (RoPE applied to q and k for llama blocks)."""
    T = x.shape[0]
    if cfg.block == "gpt2":
        h = layer_norm(x, blk.ln1_g, blk.ln1_b, cfg.layer_norm_eps)
        qkv = _project(h, blk.w_qkv, blk.b_qkv).transpose(1, 2, 0, 3)  # [3, H, T, hd]
        return h, qkv[0], qkv[1], qkv[2]
    h = rms_norm(x, blk.attn_norm, cfg.layer_norm_eps)
    qkv = _project(h, blk.w_qkv, blk.b_qkv)  # [T, KV, G + 2, hd]: each KV head's G query heads, then its k and v
    g = cfg.n_heads // cfg.n_kv_heads
    q = qkv[:, :, :g].reshape(T, cfg.n_heads, cfg.head_dim).transpose(1, 0, 2)
    k, v = qkv[:, :, g].transpose(1, 0, 2), qkv[:, :, g + 1].transpose(1, 0, 2)
    if blk.q_norm is not None:  # Gemma 3: each head's q and k normed before RoPE
        q, k = rms_norm(q, blk.q_norm, cfg.layer_norm_eps), rms_norm(k, blk.k_norm, cfg.layer_norm_eps)
    return h, rotate(q, q_pos, cfg, blk), rotate(k, q_pos, cfg, blk), v


def kv_from_h(cfg: ModelConfig, blk, key_pos: jax.Array):
    """The K/V half of a block's projection as a function h [C, D] -> float32 K, V [KV, C, hd]
    (for h modes; K rotated at key_pos [C] for llama blocks)."""
    f32 = lambda a: None if a is None else a.astype(jnp.float32)  # noqa: E731
    w_qkv = qarray.dense(blk.w_qkv)  # packed: the whole matrix dequantized (h modes only)
    if cfg.block == "gpt2":  # [D, 3, H, hd] -> k, v [D, 2, H, hd]
        w, b = f32(w_qkv[:, 1:]), f32(blk.b_qkv[1:])
    else:  # [D, KV, G + 2, hd] -> [D, 2, KV, hd]
        g = cfg.n_heads // cfg.n_kv_heads
        w = f32(w_qkv[:, :, g:].transpose(0, 2, 1, 3))
        b = f32(None if blk.b_qkv is None else blk.b_qkv[:, g:].transpose(1, 0, 2))

    def f(h):
        kv = _project(h, w, b)  # [C, 2, KV, hd]
        k, v = kv[:, 0].transpose(1, 0, 2), kv[:, 1].transpose(1, 0, 2)
        if cfg.block == "gpt2":
            return k, v
        if blk.k_norm is not None:
            k = rms_norm(k, blk.k_norm, cfg.layer_norm_eps)
        return rotate(k, key_pos, cfg, blk), v
    return f


def read_kv(cfg: ModelConfig, stored: dict, blk, kv_mode: KVMode, key_pos: jax.Array):
    """One layer's stored arrays in `kv_mode` -> float32 K, V [KV, C, hd] (h modes rebuild them
    from the block's weights, K rotated at the slots' positions key_pos [C])."""
    return kv_mode.unpack(stored, kv_from_h(cfg, blk, key_pos))


def block_out(x: jax.Array, a: jax.Array, blk, cfg: ModelConfig) -> jax.Array:
    """Residual update from the attention output a [H, T, hd], then the MLP."""
    T, eps = x.shape[0], cfg.layer_norm_eps
    mm = qarray.matmul
    o = mm(a.transpose(1, 0, 2).reshape(T, cfg.q_dim).astype(x.dtype), blk.w_o)
    if cfg.block == "gpt2":
        x = x + o + blk.b_o
        h2 = layer_norm(x, blk.ln2_g, blk.ln2_b, eps)
        return x + mm(gelu(mm(h2, blk.w_fc) + blk.b_fc), blk.w_proj) + blk.b_proj
    residual = cfg.norm_placement == "normed_residual"  # Huginn: the sums normed, not the branches
    if residual:
        x = rms_norm(x + o, blk.attn_out_norm, eps)
    else:
        x = x + (o if blk.attn_out_norm is None else rms_norm(o, blk.attn_out_norm, eps))
    gu = _project(rms_norm(x, blk.mlp_norm, eps), blk.w_gate_up, None)  # [T, 2, F]
    gate = jax.nn.gelu(gu[:, 0], approximate=True) if cfg.mlp_act == "gelu_tanh" else jax.nn.silu(gu[:, 0])
    m = mm(gate * gu[:, 1], blk.w_down)
    if residual:
        return rms_norm(x + m, blk.mlp_out_norm, eps)
    return x + (m if blk.mlp_out_norm is None else rms_norm(m, blk.mlp_out_norm, eps))
