"""The one forward step over a ragged batch of rows, on a page pool (`model.page_pool`: every
cache layer of one depth in pages of P tokens; a row's context is its page table).

Positions are implicit: the i-th entry of a row's table holds positions [i P, (i + 1) P), so a
prefix shared by many rows is one run of pages at the head of each of their tables, read by all
and written by none (a row writes only at positions >= its `start`, in pages of its own; the host
copies a shared partial last page before a row writes into it: `page_pool.copy_pages`).

One step (`forward`) feeds groups of rows, each group b rows of T tokens (`Rows`: page
tables, where each row starts, how many of its T tokens are real — a prompt chunk, one decode
token, or none); a step mixes a group of prompt chunks with a group of T = 1 decode rows, all
their tokens one [N, D] stream for the matmuls (the weights are read once per step for every
row); each block writes the step's K/V into the pages first, then each row attends to its own
pages: through a kernel that reads only live pages (`attention_kernel`: the native CPU one, or
the Pallas GPU one in `paged_pallas`), else the XLA reference, a gather of the row's R pages.
"""

from __future__ import annotations

import functools
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .. import native
from . import paged_pallas, qarray
from . import recurrence as rec
from . import transformer as tf
from . import exits
from . import kv_share
from . import layers
from .precision import exact
from .attention import attention
from .config import ModelConfig
from .kv_modes import KVMode
from .page_pool import PagedKV, gather, layer_slots, local_map, placed, read, write
from .params import Params
from .stack import Stacked, is_stacked
from .. import settings

@struct.dataclass
class Rows:
    """One step's metadata (tpu-inference's `AttentionMetadata`): B rows, each feeding the first
    n_new of its T tokens at positions start, start + 1, ..."""

    pages: Annotated[jax.Array, "int32[B, R]"]  # page tables (entries past a row's pages: any id, never read)
    start: Annotated[jax.Array, "int32[B]"]  # positions the row holds before the step
    n_new: Annotated[jax.Array, "int32[B]"]  # tokens fed this step (0: an idle row)
    window: Annotated[jax.Array, "int32[B]"] | None = None  # each row's cache_window (0: none); None: the step's

    @classmethod
    def make(cls, pages, start, n_new, window=None) -> "Rows":
        """From host lists (pages: one list per row, padded here with 0 to the longest)."""
        R = max(1, max(len(p) for p in pages))
        table = np.zeros((len(pages), R), np.int32)
        for i, p in enumerate(pages):
            table[i, :len(p)] = p
        return cls(table, np.asarray(start, np.int32), np.asarray(n_new, np.int32),
                   None if window is None else np.asarray(window, np.int32))


def over_data(x: jax.Array, mesh) -> jax.Array:
    """The step's token streams [N, D] split over 'data' (rows of a batch on their devices;
    GSPMD carries the split through the blocks), when 'data' divides N."""
    if mesh is None or x.shape[0] % mesh.shape["data"]:
        return x
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("data", None)))


# ---- reading and writing one layer ------------------------------------------------------------
# A layer's store is a pre/coda layer ({name: [lead, NP, P, w]}, index None) or the loop stack
# ({name: [L, k, lead, NP, P, w]}) at index (pass t, traced; loop block j, static).

def targets(rows: Rows, T: int, page_size: int, n_pages: int) -> tuple[jax.Array, jax.Array]:
    """Where each of the step's B T tokens is stored: (page [B T], offset [B T]); padding and
    idle rows point past the pool (page n_pages: the write is dropped)."""
    pos = rows.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    idx = jnp.clip(pos // page_size, 0, rows.pages.shape[1] - 1)
    page = jnp.take_along_axis(rows.pages, idx, axis=1)
    real = jnp.arange(T)[None] < rows.n_new[:, None]
    return jnp.where(real, page, n_pages).reshape(-1), (pos % page_size).reshape(-1)


def row_attention(cfg: ModelConfig, blk, layer: dict, q: jax.Array, q_pos: jax.Array, pages: jax.Array,
                  length: jax.Array, window, mode: KVMode | None = None) -> jax.Array:
    """The XLA reference of paged attention for one row: q [H, T, hd] at q_pos [T] over its
    pages [R] of layer (positions < length are live; window: static, or the row's traced; mode:
    the pool's, default the model's) -> [H, T, hd]. Any backend."""
    stored = gather(layer, pages)
    key_pos = jnp.arange(pages.shape[0] * next(iter(layer.values())).shape[2], dtype=jnp.int32)
    k, v = layers.read_kv(cfg, stored, blk, mode or cfg.storage, key_pos)  # h modes: K/V rebuilt, K rotated at key_pos
    return attention(q, q_pos, [(k, v, jnp.where(key_pos < length, key_pos, -1))], window)


# ---- the step ----------------------------------------------------------------------------------

class Group(struct.PyTreeNode):
    """Rows of one shape in a step: b rows of T tokens (prompt chunks, or T = 1 decode rows),
    their positions and where they write."""

    rows: Rows
    pos: jax.Array  # [b, T] absolute positions of the tokens
    page: jax.Array  # [b T] write targets (`targets`)
    off: jax.Array  # [b T]

    @classmethod
    def of(cls, rows: Rows, T: int, pool: "PagedKV") -> "Group":
        page, off = targets(rows, T, pool.page_size, pool.n_pages)
        return cls(rows, rows.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None], page, off)

    @property
    def size(self) -> int:
        return self.pos.shape[0] * self.pos.shape[1]

    @property
    def length(self) -> jax.Array:
        """[b] each row's positions after the step."""
        return self.rows.start + self.rows.n_new


def unreal_zeroed(x: jax.Array, groups: tuple) -> jax.Array:
    """x [sum of the groups' sizes, D] with the positions past each row's n_new (a chunk's
    padding, a filler or finished decode row) at zero. Nothing reads them; zero rows stay zero
    through a block without biases (the attention kernels give them zeros), and the packed-weight
    kernel skips zero rows (`native.qmatmul`), so a program's padded rows cost no products."""
    real = jnp.concatenate([(jnp.arange(g.pos.shape[1])[None] < g.rows.n_new[:, None]).reshape(-1) for g in groups])
    return jnp.where(real[:, None], x, 0)


PAGED_KERNELS = ("auto", "native", "pallas", "interpret", "xla")


def attention_kernel(cfg: ModelConfig, mode: KVMode | None = None) -> str:
    """How a step's attention runs: "native" (the CPU kernel, `native.paged_attention`),
    "pallas" (the GPU kernel, `paged_pallas`), "interpret" (that kernel interpreted: tests), or
    "xla" (the reference: a gather of each row's pages). The kernels read only live pages; they
    need K/V stored as such (h modes rebuild K/V from h: the reference) on one device.
    `TINYLOOP_PAGED_KERNEL` = auto (default: the kernel of the backend) | one of the above
    (`0`: xla, a benchmark's other arm); read when a step is traced. mode: the pool's (default
    the model's)."""
    mode = cfg.storage if mode is None else mode
    want = settings.get("TINYLOOP_PAGED_KERNEL")
    want = {"0": "xla", "1": "auto"}.get(want, want)
    if want not in PAGED_KERNELS:
        raise ValueError(f"TINYLOOP_PAGED_KERNEL={want!r}; valid: {', '.join(PAGED_KERNELS)}")
    if want == "xla" or cfg.mesh is not None or mode.h or mode.format.name not in native.PAGE_FORMATS:
        return "xla"
    if want == "auto":
        if native.available():
            return "native"
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if want == "native" and not native.available():
        return "xla"
    return want


def block(x: jax.Array, blk, cfg: ModelConfig, groups: tuple, store: dict, index, window: int,
          mode: KVMode | None = None, slot_of: jax.Array | None = None, routes: tuple | None = None):
    """One transformer block on the step's streams x [N, D] (the groups' tokens one after
    another): the step's K/V written into the pages, then each row's queries attend to the row's
    pages. mode: the pool's (default the model's; a call's working pool of an h mode holds
    float32 K/V, written as the model's mode would give them when read back). slot_of: a local
    layer's page -> slot map (`local_map`). routes: per group, which of several stores it reads
    and writes — `store` is then a tuple of (store, index, slot_of) (an engine's compact pool in
    a mixed step: the prompt chunk on the pass slots, the decode rows on the compact layers).
    Returns (x', store) (with routes: the tuple of stores)."""
    single = routes is None
    parts = ((store, index, slot_of),) if single else tuple(store)
    routes = (0,) * len(groups) if routes is None else tuple(routes)
    pos = jnp.concatenate([g.pos.reshape(-1) for g in groups])
    window = layers.layer_window(window, blk)
    h, q, k, v = layers.qkv_heads(x, blk, cfg, pos)
    mode = cfg.storage if mode is None else mode
    fresh = cfg.storage.pack(h, k, v)
    if mode != cfg.storage:  # results must not depend on where a token is kept
        fresh = mode.pack(h, *layers.read_kv(cfg, fresh, blk, cfg.storage, pos))
    spans = np.cumsum([0] + [g.size for g in groups])  # each group's tokens in the stream
    stores = []
    for s_, (st, idx, m) in enumerate(parts):  # each store written with its groups' tokens
        mine = [i for i, r in enumerate(routes) if r == s_]
        if mine:
            take = (lambda a: a) if len(mine) == len(groups) else (lambda a: jnp.concatenate(
                [a[:, spans[i]:spans[i + 1]] for i in mine], axis=1))
            page = local_map(m, jnp.concatenate([groups[i].page for i in mine]), layer_slots(st), write=True)
            st = write(st, {n: take(a) for n, a in fresh.items()}, page,
                       jnp.concatenate([groups[i].off for i in mine]), idx)
        stores.append(st)
    H, _, hd = q.shape
    q = q.astype(jnp.float32)
    kernel = attention_kernel(cfg, mode)
    layer = [None if kernel != "xla" else read(st, idx) for st, (_, idx, _) in zip(stores, parts)]
    outs = []
    for g, r, lo in zip(groups, routes, spans):
        st, (_, idx, m) = stores[r], parts[r]
        b, T = g.pos.shape
        table = local_map(m, g.rows.pages, 0)
        qg = q[:, lo:lo + b * T].reshape(H, b, T, hd).transpose(1, 0, 2, 3)  # [b, H, T, hd]
        rows_window = None if g.rows.window is None else layers.layer_window(g.rows.window, blk)
        win = jnp.full((b,), window, jnp.int32) if rows_window is None else rows_window  # [b]
        if kernel != "xla":  # the stack itself and the layer's index: no copy of the layer
            i = 0 if idx is None else idx[0] if len(idx) == 1 else idx[0] * len(cfg_loop(st)) + idx[1]
            run = (native.paged_attention if kernel == "native" else
                   functools.partial(paged_pallas.paged_attention, interpret=kernel == "interpret"))
            a = run((qg * hd ** -0.5).transpose(0, 2, 1, 3), st["k"], st["v"], st.get("ks"),
                    st.get("vs"), table, g.rows.start, g.rows.n_new, jnp.asarray(i, jnp.int32),
                    mode.format.name, win, cfg.n_kv_heads).transpose(0, 2, 1, 3)
        else:  # each row's own window (traced), or the step's
            w = win if rows_window is not None else jnp.full((b,), -1, jnp.int32)
            a = jax.vmap(lambda q_, p_, t_, n_, w_, lay=layer[r]: row_attention(
                cfg, blk, lay, q_, p_, t_, n_, window if rows_window is None else w_, mode))(
                    qg, g.pos, table, g.length, w)
        outs.append(a.transpose(1, 0, 2, 3).reshape(H, b * T, hd))
    y = layers.block_out(x, jnp.concatenate(outs, axis=1), blk, cfg)
    return y, (stores[0] if single else tuple(stores))


def run_pre(params: Params, cfg: ModelConfig, x: jax.Array, groups: tuple, pool: PagedKV, window: int, keep=None):
    """The step's streams x [N, D] through the pre blocks, their K/V written into the pool's
    pre layers. Returns (x, pool), and with keep(x) -> [b, D] (some positions' streams) also
    those after each block [n_pre, b, D]. Blocks stacked (`model.stack`) over a stacked pool run
    in a layer loop: one block in the program, whatever the depth."""
    kept = []
    if is_stacked(pool.pre):  # the pool's pre layers one stack, layer i at index (i,)
        def one(i, blk, carry):
            x, store = block(carry[0], blk, cfg, groups, carry[1], (i,), window, pool.kv_mode)
            return x, store, None if keep is None else carry[2].at[i].set(keep(x))
        carry = (x, pool.pre.tree, None if keep is None else
                 jnp.zeros((len(params.pre), *jax.eval_shape(keep, x).shape), x.dtype))
        if is_stacked(params.pre):  # the blocks stacked too: a layer loop
            carry = jax.lax.fori_loop(0, len(params.pre), lambda i, c: one(i, params.pre.at(i), c), carry)
        else:  # blocks that differ (packed formats): unrolled
            for j, blk in enumerate(params.pre):
                carry = one(j, blk, carry)
        pool = pool.replace(pre=Stacked(carry[1]))
        return (carry[0], pool) if keep is None else (carry[0], pool, carry[2])
    pre = []
    for j, (blk, store) in enumerate(zip(params.pre, pool.pre)):
        x, store = block(x, blk, cfg, groups, store, None, window, pool.kv_mode, pool.map_of(j))
        pre.append(store)
        if keep is not None:
            kept.append(keep(x))
    pool = pool.replace(pre=tuple(pre))
    if keep is None:
        return x, pool
    return x, pool, jnp.stack(kept) if kept else jnp.zeros((0, *jax.eval_shape(keep, x).shape), x.dtype)


def cfg_loop(store: dict) -> range:
    """The loop blocks of a loop stack's arrays [L, k, ...]."""
    return range(next(iter(store.values())).shape[1])


def embed(params: Params, tokens: jax.Array, pos: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens, pos [N] -> the residual stream [N, D] (learned positions clamped, embed_scale, as
    `tf.embed`)."""
    x = qarray.take(params.wte, tokens)
    if cfg.embed_scale != 1.0 and not rec.injected(cfg):
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    if params.wpe is None:
        return x
    return x + params.wpe[jnp.minimum(pos, params.wpe.shape[0] - 1)]


def as_groups(rows, tokens) -> tuple[tuple, tuple]:
    """One group (Rows, tokens [b, T]) or several ((Rows, ...), (tokens, ...)) -> two tuples."""
    if isinstance(rows, Rows):
        return (rows,), (tokens,)
    return tuple(rows), tuple(tokens)


@exact
def forward(params: Params, cfg: ModelConfig, pool: PagedKV, rows, tokens, loops: int, window: int,
            exit: exits.Exit | None = None, seeds=None, keep_state: bool = False, prompts: tuple = (),
            keep_depths: bool = False):
    """One step: groups of rows, each `Rows` [b, R] with its tokens [b, T] (row i's first
    n_new[i] real, at positions start[i] + t), through every layer at depth `loops` (static, or
    traced: a speculative draft's), their K/V written into the rows' pages. `rows`, `tokens` (and
    `seeds`: [b] uint32 each, the injection models' initial states; None: 0) are one group or
    tuples of groups; float tokens [b, T, D] (injection models: the (state | e) carry [b, T, 2D])
    are streams entering the passes, the pre blocks not run (a deeper prefix's passes). Returns
    (the streams the logits come from, [b, T, D] per group (a tuple for tuples), the pool); keep_state: also the
    streams after the last pass (before the coda; injection models: the loop state), the same way.
    prompts: per group, whether it is a prompt chunk — on an engine's compact pool (`kv_share`)
    a prompt group's loop layers are its pass slots (every pass), the others' the compact ones.
    keep_depths: also the first group's rows' last fed tokens' streams after each pre block and
    pass [b, n_pre + loops, D] (a prefix's depth states) and, for injection models, its input
    to every pass [b, T, D] (else None): last in what is returned."""
    single = isinstance(rows, Rows)
    rows, tokens = as_groups(rows, tokens)
    share = pool.share
    if share.full and isinstance(loops, int) and pool.passes < loops:  # (traced: a draft depth, checked by its caller)
        raise ValueError(f"a pool of {pool.passes} passes cannot run loops={loops}")
    if not share.full:
        if not isinstance(loops, int):
            raise ValueError(f"kv_share={share} runs a fixed depth (no speculative drafts yet), got a traced depth")
        share.check(loops)
        if pool.passes != share.slots(loops):
            raise ValueError(f"a compact pool of {pool.passes} slots is not kv_share={share}'s at loops={loops}")
    groups = tuple(Group.of(r, t.shape[1], pool) for r, t in zip(rows, tokens))
    pos = jnp.concatenate([g.pos.reshape(-1) for g in groups])
    inject = rec.injected(cfg)
    entering = jnp.issubdtype(tokens[0].dtype, jnp.floating)  # streams entering the passes: no pre blocks
    if entering:
        x = jnp.concatenate([t.reshape(g.size, -1) for g, t in zip(groups, tokens)])
    else:
        x = embed(params, jnp.concatenate([t.reshape(-1) for t in tokens]), pos, cfg)
        x = x * cfg.embed_scale if inject and cfg.embed_scale != 1.0 else x
    x = unreal_zeroed(over_data(x, cfg.mesh), groups)

    keep = None
    if keep_depths:  # the first group's rows' last real tokens in the step's stream
        g0 = groups[0]
        at = jnp.arange(g0.pos.shape[0]) * g0.pos.shape[1] + jnp.maximum(g0.rows.n_new - 1, 0)
        keep = lambda x: x[at]  # noqa: E731
    e = None
    if entering:  # a deeper prefix's: (state | e) for injection models
        x, e = rec.split_carry(x) if inject else (x, None)
        pre_kept = [jnp.zeros((0, *keep(x).shape), x.dtype)] if keep_depths else []
    else:
        x, pool, *pre_kept = run_pre(params, cfg, x, groups, pool, window, keep)
    if inject and not entering:
        seeds = (seeds,) if single else (seeds or (None,) * len(groups))
        states = []
        for g, sd in zip(groups, seeds):
            sd = jnp.zeros(g.pos.shape[:1], jnp.uint32) if sd is None else sd
            states.append(jax.vmap(lambda seed, p: rec.initial_state(cfg, seed, p))(sd, g.pos).reshape(g.size, -1))
        e, x = x, over_data(jnp.concatenate(states), cfg.mesh)
    gated = exit is not None and cfg.early_exit_gate

    def loop_block(x, blk, stack, index):  # (loop_of: a prompt's pass slots, `page_pool.swap`)
        return block(x, blk, cfg, groups, stack, index, window, pool.kv_mode, pool.loop_of)

    def post_block(y, blk, store, j):
        return block(y, blk, cfg, groups, store, None, window, pool.kv_mode)

    if any(prompts) and pool.aside is not None and pool.loop_of is None:  # a mixed step on a compact pool
        if keep_depths:
            raise ValueError("keep_depths: a prompt's depth states are kept on a pool without pass slots")
        x, (loop, aside), pick = mixed_passes(params, cfg, pool, groups, tuple(prompts), x, e, loops, window,
                                              exit if gated else None)
        pool = pool.replace(aside=aside)
    else:
        x, loop, passes, pick = tf.run_passes(params, cfg, x, e, loops, pool.loop, loop_block,
                                              exit if gated else None, keep, slot=share.slot,
                                              settle=settle(share, pool.kv_mode, groups, loops, pool.loop))
    y, post = tf.coda(params, cfg, x, pool.post, post_block)
    pool = placed(pool.replace(loop=loop, post=tuple(post)), cfg.mesh)
    out = split(pick if gated else y, groups, single)
    got = (out, pool, split(x, groups, single)) if keep_state else (out, pool)
    if keep_depths:  # [n_pre + loops, b, D] -> [b, n_pre + loops, D]
        got += (jnp.concatenate([pre_kept[0], passes]).transpose(1, 0, 2),
                None if e is None else split(e, groups, False)[0])
    return got


def mixed_passes(params: Params, cfg: ModelConfig, pool: PagedKV, groups: tuple, prompts: tuple, x, e, loops: int,
                 window: int, exit):
    """The passes of a step mixing prompt chunks with decode rows on an engine's compact pool:
    a prompt group reads and writes pass t of its pass slots (`aside`, every pass kept until
    its prompt ends), a decode group the compact layers (slot(t), settled after the last pass
    as `forward`'s). Returns (x, (compact stack, pass stack), the exit's pick)."""
    share = pool.share
    routes = tuple(1 if p else 0 for p in prompts)
    decoding = tuple(g for g, p in zip(groups, prompts) if not p)

    def loop_block(x, blk, stacks, index):
        i, j = index
        parts = ((stacks[0], (share.slot(i), j), None), (stacks[1], (i, j), pool.aside_of))
        return block(x, blk, cfg, groups, parts, None, window, pool.kv_mode, routes=routes)

    last = settle(share, pool.kv_mode, decoding, loops, pool.loop) if decoding else None
    both = None if last is None else tf.Settle(last.start, lambda i, st, acc: last.after(i, st[0], acc),
                                               lambda st, acc: (last.end(st[0], acc), st[1]))
    x, stacks, _, pick = tf.run_passes(params, cfg, x, e, loops, (pool.loop, pool.aside), loop_block, exit,
                                       settle=both)
    return x, stacks, pick


def settle(share, mode: KVMode, groups: tuple, loops: int, stack0: dict) -> tf.Settle | None:
    """A compact pool's (`kv_share`) last word on the step's tokens, where the last pass written
    is not what later tokens read: avg writes the mean of the passes' K/V, first pass 0's.
    stack0: the loop stack before the step (shapes)."""
    if share.kind not in ("avg", "first"):
        return None
    page = jnp.concatenate([g.page for g in groups])
    off = jnp.concatenate([g.off for g in groups])
    k = next(iter(stack0.values())).shape[1]
    now = lambda stack: [kv_share.take_at(stack, j, page, off) for j in range(k)]  # noqa: E731
    if share.kind == "first":
        def after(i, stack, acc):
            return jax.lax.cond(i == 0, lambda: now(stack), lambda: acc)

        def end(stack, acc):
            for j in range(k):
                stack = kv_share.put_at(stack, j, page, off, acc[j])
            return stack
        return tf.Settle(now(stack0), after, end)

    def sums(stack, acc):
        return [tuple(a + b for a, b in zip(mode.unpack(t, None), s)) for t, s in zip(now(stack), acc)]

    def end_avg(stack, acc):
        for j, (sk, sv) in enumerate(acc):
            stack = kv_share.put_at(stack, j, page, off, mode.pack(None, sk / loops, sv / loops))
        return stack
    zero = [tuple(jnp.zeros_like(a) for a in mode.unpack(t, None)) for t in now(stack0)]
    return tf.Settle(zero, lambda i, stack, acc: sums(stack, acc), end_avg)


def split(x: jax.Array, groups: tuple, single: bool):
    """The step's streams [N, D] back into the groups' [b, T, D] (one array for one group)."""
    outs, at = [], 0
    for g in groups:
        outs.append(x[at:at + g.size].reshape(*g.pos.shape, -1))
        at += g.size
    return outs[0] if single else tuple(outs)


def last_logits(params: Params, cfg: ModelConfig, x: jax.Array, rows: Rows) -> jax.Array:
    """Each row's next-token logits [B, V] after its last fed token (x [B, T, D] from `forward`)."""
    last = jnp.maximum(rows.n_new - 1, 0)
    return tf.lm_head(params, cfg, jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0])


