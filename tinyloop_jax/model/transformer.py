"""The looped forward pass as pure functions over (params, cache segments): GPT-2 or Llama
blocks (RMSNorm, RoPE, SwiGLU, grouped-query attention), a stack of k loop blocks, Ouro's
sandwich norms, per-pass final norm and early-exit gate, Huginn's normed residuals, adjacent-pair
RoPE and concat adapter (see `recurrence`).

One function, `run_layers`, serves prefill (a chunk of T tokens), decode (T = 1) and the
extra passes of a deeper prefix. A chunk is written into its own segment, then attends to
its keys with one softmax over all of them (see `attention`):

    read-only segments (a shared prefix)  +  own segment (earlier tokens and the chunk)

(under a sliding window, whose ring buffer a long chunk may overrun, the chunk attends to
itself directly and is written after). The pre blocks run one after another; the loop
stack's passes run under `lax.fori_loop` over the stacked pass axis of the caches, so a
program's size does not depend on the depth.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import cache as kvc
from . import int4_attention as i4
from . import qarray
from . import recurrence as rec
from .attention import attention, normalize
from .cache import KVCache
from .config import ModelConfig
from .kv_modes import KVMode
from .params import Params


def exact(fn):
    """Run `fn(params, cfg, ...)` with float32 matmuls when the model computes in float32: XLA's
    default on GPUs is TF32 (10-bit mantissas), which moved Ouro's logits by 0.1 and changed
    greedy tokens on an H200 (scripts/gpu_parity.py). On CPU the programs compute the same."""
    @functools.wraps(fn)
    def wrapped(params, cfg, *args, **kwargs):
        if cfg.dtype != "float32":
            return fn(params, cfg, *args, **kwargs)
        with jax.default_matmul_precision("float32"):
            return fn(params, cfg, *args, **kwargs)
    return wrapped


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


def embed(params: Params, tokens: jax.Array, start_pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens [T] at positions start_pos + i -> the residual stream [T, D] (times embed_scale
    (Gemma) unless the model is an injection model, whose pre blocks' output is scaled where
    the recurrence starts: `run_pre`)."""
    x = qarray.take(params.wte, tokens)
    if cfg.embed_scale != 1.0 and not rec.injected(cfg):
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    if params.wpe is None:  # RoPE models: positions enter in attention
        return x
    q_pos = start_pos + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    # clamped only for tokens whose outputs are discarded (bucket padding, speculative drafts past
    # max_tokens): real positions past the table are refused on the host (`ModelConfig.check_positions`)
    return x + params.wpe[jnp.minimum(q_pos, params.wpe.shape[0] - 1)]


@exact
def lm_head(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Streams [..., D] after the last pass -> float32 logits [..., V]: the final norm (already
    applied with `pass_norm`), then the head (the tied embedding unless the model has its own)."""
    if not cfg.pass_norm:
        x = final_norm(params, cfg, x)
    w = params.wte if params.head is None else params.head
    logits = qarray.head(x, w)
    if cfg.mesh is not None:  # computed where the vocabulary-split head is, then gathered once: no
        # collectives in sampling, and the head's weights never move
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, P(*[None] * (logits.ndim - 1),
                                                                                      "model")))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(cfg.mesh, P()))
    return logits if w.shape[0] == cfg.vocab_size else logits[..., :cfg.vocab_size]  # a mesh's vocabulary padding


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


class Exit(NamedTuple):
    """Which pass's output gives the logits (Ouro's early exit; every pass still runs). step >= 0:
    that pass (0-based); else the first pass whose cumulative exit probability reaches
    `threshold` (> 1: never, i.e. the last pass)."""
    step: jax.Array  # int32 []
    threshold: jax.Array  # float32 []

    @classmethod
    def make(cls, step: int | None = None, threshold: float | None = None) -> "Exit":
        return cls(jnp.int32(-1 if step is None else step), jnp.float32(2.0 if threshold is None else threshold))


def gate(params: Params, x: jax.Array) -> jax.Array:
    """The exit gate's probability lambda [..] of a pass output x [.., D]."""
    return jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), params.gate_w.astype(jnp.float32)) + params.gate_b)


def exit_prob(lam: jax.Array, remaining: jax.Array, last) -> tuple[jax.Array, jax.Array]:
    """One pass of Ouro's exit distribution: p_t = lambda_t * prod_{s<t} (1 - lambda_s), the
    last pass taking what remains. Returns (p_t, remaining after pass t)."""
    return jnp.where(last, remaining, lam * remaining), remaining * (1.0 - lam)


def exit_distribution(params: Params, pass_states: jax.Array) -> jax.Array:
    """Pass outputs [passes, ..., D] -> the exit distribution [passes, ...] (sums to 1)."""
    rem, pdf = jnp.ones(pass_states.shape[1:-1], jnp.float32), []
    for t in range(pass_states.shape[0]):
        p, rem = exit_prob(gate(params, pass_states[t]), rem, t == pass_states.shape[0] - 1)
        pdf.append(p)
    return jnp.stack(pdf)


class ExitCarry(NamedTuple):
    """The early exit's running pick over the passes, per position of a chunk of T tokens."""
    x: jax.Array  # [T, D] the stream of the pass taken (zeros until one is)
    remaining: jax.Array  # [T] float32: exit probability not yet given to a pass
    cumulative: jax.Array  # [T] float32: exit probability of the passes so far
    chosen: jax.Array  # [T] bool: a pass was taken

    @classmethod
    def start(cls, x: jax.Array) -> "ExitCarry":
        """Before the first pass, for streams like x [T, D]."""
        T = x.shape[0]
        return cls(jnp.zeros_like(x), jnp.ones((T,), jnp.float32), jnp.zeros((T,), jnp.float32),
                   jnp.zeros((T,), bool))

    def pick(self, last: jax.Array) -> jax.Array:
        """The streams the logits come from [T, D]: the taken pass's, else `last` (the last pass's)."""
        return jnp.where(self.chosen[:, None], self.x, last)


def exit_update(params: Params, ex: Exit, i, last, x: jax.Array, carry: ExitCarry) -> ExitCarry:
    """Fold pass i's output x [T, D] into the exit's pick: the pass is taken if it is `ex.step`,
    or (no step) the first whose cumulative exit probability reaches `ex.threshold`. `last`:
    pass i is the last one (it takes what probability remains)."""
    p, remaining = exit_prob(gate(params, x), carry.remaining, last)
    cumulative = carry.cumulative + p
    take = jnp.where(ex.step >= 0, i == ex.step, ~carry.chosen & (cumulative >= ex.threshold))
    return ExitCarry(jnp.where(take[:, None], x, carry.x), remaining, cumulative, carry.chosen | take)


class Chunk(NamedTuple):
    """Where a chunk of T tokens goes: q_pos [T] absolute positions; self_pos [T] the same with
    padding at -1 (so the chunk's padding is never a key); slots [T] own-segment slots (>= C:
    not stored)."""
    q_pos: jax.Array
    self_pos: jax.Array
    slots: jax.Array
    src: jax.Array  # [C] the chunk token each own slot takes (-1: none; `cache.write_sources`)


class Layer(NamedTuple):
    """One cache layer of a segment as attention reads it."""
    stored: dict  # arrays [lead, C, w] in kv_mode
    key_pos: jax.Array  # [C]
    kv_mode: KVMode


def block(x: jax.Array, blk, cfg: ModelConfig, chunk: Chunk, ro: list, own: KVCache, store: dict,
          index, window: int):
    """One transformer block on a chunk x [T, D]. ro: this layer of each read-only segment
    ([Layer]); store: own's arrays for this layer — a pre layer (index None) or the loop stack
    (index = (pass, loop block)). Returns (x', store with the chunk written)."""
    window = layer_window(window, blk)
    h, q, k, v = qkv_heads(x, blk, cfg, chunk.q_pos)
    fresh = cfg.storage.pack(h, k, v)
    if own.kv_mode != cfg.storage:
        # A call-scoped working segment (see `materialize`): store the values the model's mode
        # would give when read back, so results do not depend on where a token is kept.
        fresh = own.kv_mode.pack(h, *read_kv(cfg, fresh, blk, cfg.storage, chunk.q_pos))
    if x.shape[0] == 1 or window == 0:
        # Write first, then attend to the updated buffer: one partial softmax over the own
        # segment, the chunk included. The data dependency lets XLA update the buffer in place
        # (reading the old buffer beside the write forces a copy of it), and a prefill computes
        # the chunk's scores once, not against the old buffer and again against itself. Without
        # a window every real token of the chunk is stored (own segments are sized for them).
        store = kvc.write(store, fresh, chunk.slots, chunk.src, index)
        segs = ro + [Layer(kvc.read(store, index), kvc.write_positions(own.pos, chunk.q_pos, chunk.slots, chunk.src),
                           own.kv_mode)]
        if x.shape[0] == 1 and all(s.kv_mode.packed_int4 for s in segs):
            return block_out(x, attention_int4_decode(q, chunk.q_pos, segs, window, cfg.int4_attention, cfg.mesh),
                             blk, cfg), store
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode, s.key_pos), s.key_pos) for s in segs]
    else:
        # Prefill under a window: the chunk attends to itself directly (it may be longer than the
        # ring buffer), seeing its K/V exactly as a cache would hold them; then it is written.
        kvs = [(*read_kv(cfg, s.stored, blk, s.kv_mode, s.key_pos), s.key_pos) for s in ro]
        kvs.append((*read_kv(cfg, kvc.read(store, index), blk, own.kv_mode, own.pos), own.pos))
        kvs.append((*read_kv(cfg, fresh, blk, own.kv_mode, chunk.q_pos), chunk.self_pos))
        store = kvc.write(store, fresh, chunk.slots, chunk.src, index)
    return block_out(x, attention(q.astype(jnp.float32), chunk.q_pos, kvs, window), blk, cfg), store


def attention_int4_decode(q: jax.Array, q_pos: jax.Array, segs: list, window: int, impl: str,
                          mesh=None) -> jax.Array:
    """Decode (T = 1) attention over int4 segments read packed: one partial softmax per segment
    (the Pallas kernel on GPU), merged by log-sum-exp. On a mesh the kernel runs per device under
    `shard_map` over heads (XLA cannot split a custom kernel itself)."""
    qs = q[:, 0].astype(jnp.float32) * q.shape[-1] ** -0.5
    f = partial(i4.int4_attention, window=window, impl=impl)
    if mesh is not None and impl != "jnp":
        heads, rep = P("model"), P()
        f = jax.shard_map(f, mesh=mesh, in_specs=(heads, rep, heads, heads, heads, heads, rep),
                          out_specs=(heads, heads, heads), check_vma=False)
    parts = [f(qs, q_pos[0], s.stored["k"], s.stored["ks"], s.stored["v"], s.stored["vs"], s.key_pos) for s in segs]
    return normalize(parts)[:, None]


class Run(NamedTuple):
    """What `run_layers` returns."""
    x: jax.Array  # [T, D] the streams after the last pass (before the coda); injection: (state | e) [T, 2D]
    own: KVCache  # own with the chunk appended
    states: jax.Array | None  # [n_pre + loops, D] the last real token's stream after each pre block and pass
    exit_x: jax.Array  # [T, D] the streams the logits come from (after the coda; or the early exit's pick)


@exact
def run_layers(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
               ro: tuple, own: KVCache, loops: int, window: int, keep_states: bool = False,
               exit: Exit | None = None, seed: jax.Array | None = None) -> Run:
    """Run a chunk's stream x [T, D] through own's layers and append the chunk to `own`.

    Only the first n_valid of the T tokens are real (the rest is bucket padding); they sit at
    absolute positions start_pos + i. `own` holds either every pre layer or none (then x is the
    stream entering the first pass), and at least `loops` passes; `ro` segments (a prefix) hold
    every pre layer and at least `loops` passes. Passes 0..loops-1 run (each pass the k loop
    blocks in order, then the final norm with `pass_norm`); deeper ones are not touched. Then the
    coda blocks, whose layers every segment holds (at this depth). With a gate model and `exit`,
    `exit_x` is the exit's pick among the passes' outputs.

    Injection models (`recurrence`): x is the chunk's embeddings [T, D] (scaled here by
    embed_scale; the initial states drawn from `seed`, uint32 [], None: 0), or, when own holds
    no pre layers, the (state | e) carry [T, 2D] an earlier call returned as `Run.x`.
    """
    T, n_pre = x.shape[0], len(own.pre)
    inject = rec.injected(cfg)
    continuing = inject and x.shape[-1] == 2 * cfg.d_model
    if (n_pre not in (0, cfg.n_pre_blocks) or own.passes < loops or any(s.passes < loops for s in ro)
            or any(len(s.post) != cfg.n_post_blocks for s in (own, *ro))
            or (inject and n_pre != (0 if continuing else cfg.n_pre_blocks))):
        raise ValueError(f"segments do not fit loops={loops}: own has {n_pre} pre layers, {own.passes} passes and "
                         f"{len(own.post)} coda layers, read-only segments have {[s.passes for s in ro]} passes"
                         + (f"; an injection model takes embeddings [T, D] with every pre layer or its (state | e) "
                            f"carry [T, 2D] with none, got x {tuple(x.shape)}" if inject else ""))
    chunk = make_chunk(start_pos, n_valid, T, own.capacity)
    ring = make_chunk(start_pos, n_valid, T, own.ring_capacity) if own.rings else None
    last = jnp.maximum(n_valid - 1, 0)
    at_last = lambda x: jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False)  # noqa: E731
    gated = exit is not None and cfg.early_exit_gate

    x, e, pre, states = run_pre(params, cfg, x, chunk, ro, own, window, seed, continuing, ring)

    def one_pass(i, carry):
        x, stack, passes, sel = carry
        x, stack = loop_pass(params, cfg, i, x, e, stack, chunk, ro, own, window)
        if keep_states:
            passes = passes.at[i].set(at_last(x))
        if gated:
            sel = exit_update(params, exit, i, i == loops - 1, x, sel)
        return x, stack, passes, sel

    passes = jnp.zeros((loops, x.shape[1]), x.dtype) if keep_states else None
    sel = ExitCarry.start(x) if gated else None
    x, loop, passes, sel = jax.lax.fori_loop(0, loops, one_pass, (x, own.loop, passes, sel))
    y, post = run_coda(params, cfg, x, chunk, ro, own, own.post, window)
    new_own = own.replace(pre=tuple(pre), loop=loop, post=post,
                          pos=kvc.write_positions(own.pos, chunk.q_pos, chunk.slots, chunk.src),
                          ring_pos=None if ring is None else kvc.write_positions(own.ring_pos, ring.q_pos, ring.slots,
                                                                                 ring.src),
                          length=(start_pos + n_valid).astype(jnp.int32))
    if keep_states:
        states = jnp.concatenate([jnp.stack(states), passes]) if states else passes
    exit_x = sel.pick(x) if gated else y
    return Run(rec.carry(x, e) if inject else x, new_own, states if keep_states else None, exit_x)


def make_chunk(start_pos: jax.Array, n_valid: jax.Array, T: int, capacity: int) -> Chunk:
    """Where a chunk of T tokens (the first n_valid real) at start_pos goes in a segment of
    `capacity` slots."""
    q_pos = start_pos + jnp.arange(T, dtype=jnp.int32)
    return Chunk(q_pos, jnp.where(jnp.arange(T) < n_valid, q_pos, -1), kvc.write_slots(q_pos, n_valid, capacity),
                 kvc.write_sources(start_pos, n_valid, capacity))


def run_pre(params: Params, cfg: ModelConfig, x: jax.Array, chunk: Chunk, ro: tuple, own: KVCache, window: int,
            seed: jax.Array | None, continuing: bool = False, ring: Chunk | None = None):
    """The chunk through own's pre blocks (if it holds them; its ring layers written by `ring`,
    the chunk placed in their slots). Returns (the stream entering the first pass [T, D]
    (injection: the initial state), the pre blocks' output e (injection, else None), own's pre
    layers with the chunk written, the last real token's stream after each pre block ([D] each))."""
    inject = rec.injected(cfg)
    last = jnp.maximum(jnp.sum(chunk.self_pos >= 0) - 1, 0)
    if continuing:
        x, e = rec.split_carry(x)
    elif inject and cfg.embed_scale != 1.0:  # other models' embeddings are scaled by `embed`
        x = x * cfg.embed_scale
    e = e if continuing else None
    pre, states = [], []
    ring_own = own.replace(pos=own.ring_pos) if own.rings else None
    for j, store in enumerate(own.pre):
        layers = [Layer(s.pre[j], s.pre_pos(j), s.kv_mode) for s in ro]
        mine, at = (ring_own, ring) if j in own.rings else (own, chunk)
        x, store = block(x, params.pre[j], cfg, at, layers, mine, store, None, window)
        pre.append(store)
        states.append(jax.lax.dynamic_index_in_dim(x, last, axis=0, keepdims=False))
    if inject and not continuing:
        e, x = x, rec.initial_state(cfg, seed, chunk.q_pos)
    return x, e, pre, states


def loop_pass(params: Params, cfg: ModelConfig, i, x: jax.Array, e: jax.Array | None, stack: dict, chunk: Chunk,
              ro: tuple, own: KVCache, window: int):
    """Pass i (traced) of the loop stack over the chunk's streams x [T, D] (injection: the
    state, with the pre blocks' output e), writing pass i's layers of `stack`. Returns (x after
    the pass (its final norm with `pass_norm`), stack)."""
    if e is not None:
        x = rec.pass_input(params, x, e)
    for j, blk in enumerate(params.loop):
        layers = [Layer(kvc.read(s.loop, (i, j)), s.pos, s.kv_mode) for s in ro]
        x, stack = block(x, blk, cfg, chunk, layers, own, stack, (i, j), window)
    if cfg.pass_norm:
        x = final_norm(params, cfg, x)
    return x, stack


def run_coda(params: Params, cfg: ModelConfig, x: jax.Array, chunk: Chunk, ro: tuple, own: KVCache, post: tuple,
             window: int):
    """After the last pass: the final norm (`norm_before_coda`), then the coda blocks writing
    the chunk into `post` (own's coda layers). Returns (streams for the head [T, D], post)."""
    y, out = (final_norm(params, cfg, x) if cfg.norm_before_coda else x), []
    for j, store in enumerate(post):
        layers = [Layer(s.post[j], s.pos, s.kv_mode) for s in ro]
        y, store = block(y, params.post[j], cfg, chunk, layers, own, store, None, window)
        out.append(store)
    return y, tuple(out)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, n_valid: jax.Array, start_pos: jax.Array,
            ro: tuple, own: KVCache, loops: int, window: int, exit: Exit | None = None,
            seed: jax.Array | None = None):
    """Embed tokens [T] (positions start_pos + i) and run them through every layer, appending
    them to `own`. `seed` (uint32 []): injection models' initial states. Returns (the streams
    the logits come from [T, D], new own)."""
    out = run_layers(params, cfg, embed(params, tokens, start_pos, cfg), n_valid, start_pos, ro, own, loops, window,
                     exit=exit, seed=seed)
    return out.exit_x, out.own


def last_logits(params: Params, cfg: ModelConfig, x: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Next-token logits [V] after the last real token of streams x [T, D]."""
    return lm_head(params, cfg, jax.lax.dynamic_index_in_dim(x, jnp.maximum(n_valid - 1, 0), axis=0, keepdims=False))


@exact
def exit_stream(params: Params, cfg: ModelConfig, pass_states: jax.Array, exit: Exit | None) -> jax.Array:
    """One position's pass outputs [loops, D] -> the stream its logits come from [D]."""
    if exit is None or not cfg.early_exit_gate:
        return pass_states[-1]
    sel, n = ExitCarry.start(pass_states[:1]), pass_states.shape[0]
    for i in range(n):  # a handful of [D] dot products
        sel = exit_update(params, exit, i, i == n - 1, pass_states[i:i + 1], sel)
    return sel.pick(pass_states[-1:])[0]


@exact
def materialize(params: Params, cfg: ModelConfig, seg: KVCache, passes: int) -> KVCache:
    """The segment's first `passes` passes with K/V stored in float32 ("fp32" mode): for h modes,
    K/V rebuilt from the stored h once, so that a whole call (every decode step, every request
    of a batch) reads them instead of re-projecting h at each step."""
    kv = lambda stored, blk: dict(zip("kv", read_kv(cfg, stored, blk, seg.kv_mode, seg.pos)))  # noqa: E731
    loop = {n: a[:passes] for n, a in seg.loop.items()}  # [passes, k, ...]
    per_block = [jax.vmap(lambda e, b=b: kv(e, b))({n: a[:, j] for n, a in loop.items()})
                 for j, b in enumerate(params.loop)]
    pre = tuple(dict(zip("kv", read_kv(cfg, e, b, seg.kv_mode, seg.pre_pos(j))))
                for j, (e, b) in enumerate(zip(seg.pre, params.pre)))
    return seg.replace(pre=pre,
                       loop={n: jnp.stack([p[n] for p in per_block], axis=1) for n in "kv"},
                       post=tuple(kv(e, b) for e, b in zip(seg.post, params.post)), kv_mode="fp32")


@exact
def forward_seq(params: Params, cfg: ModelConfig, tokens: jax.Array, loops: int, window: int = 0,
                seed: jax.Array | None = None) -> jax.Array:
    """Cache-free forward over a whole sequence (training and evaluation): tokens [T] -> logits
    [T, V]. K/V pass through the kv_mode round trip, as the cached path sees them. The passes
    run under `lax.scan` (differentiable, one copy of the loop stack in the program). `seed`:
    injection models' initial states (as `run_layers`)."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def layer(x, blk):
        h, q, k, v = qkv_heads(x, blk, cfg, pos)
        k, v = read_kv(cfg, cfg.storage.pack(h, k, v), blk, cfg.storage, pos)  # as a cache would hold them
        return block_out(x, attention(q.astype(jnp.float32), pos, [(k, v, pos)], layer_window(window, blk)), blk, cfg)

    inject = rec.injected(cfg)

    def one_pass(x, _):
        if inject:
            x = rec.pass_input(params, x, e)
        for blk in params.loop:
            x = layer(x, blk)
        return (final_norm(params, cfg, x) if cfg.pass_norm else x), None

    x = embed(params, tokens, jnp.int32(0), cfg)
    if inject and cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale
    for blk in params.pre:
        x = layer(x, blk)
    if inject:
        e, x = x, rec.initial_state(cfg, seed, pos)
    x, _ = jax.lax.scan(one_pass, x, None, length=loops)
    if cfg.norm_before_coda:
        x = final_norm(params, cfg, x)
    for blk in params.post:
        x = layer(x, blk)
    return lm_head(params, cfg, x)
