"""The paged KV cache and the one forward step over a ragged batch of rows.

A pool holds pages of P tokens; a page holds those tokens' stored K/V (or h) in *every* cache
layer of one depth — pre blocks, the L x k loop passes, the coda — so a row's context is one
list of page ids (its page table), the same for every layer:

    pre[j]  = {"k": [KV, NP, P, hd], "v": ...}              one per pre block   (layout: kv_modes)
    loop    = {"k": [L, k, KV, NP, P, hd], "v": ...}        L passes of the k loop blocks
    post[j] = like pre[j]                                    one per coda block
    page table of a row: [R] int32; its position p lives in page table[p // P], offset p % P

A model whose pre blocks have windows of their own (Gemma's local layers) may keep those layers
in *local slots* instead (`empty(n_local=)`): their arrays have NL < NP slots, and `slot_of [NP]`
says which slot holds a page's K/V for them (-1: none, for pages outside every query's window);
`local_map` turns a row's table and write targets into slots, so the tables stay the pages'.
The host moves slots with the windows (the engine's `LocalSlots`; `generate`'s pools a static
ring per row).

Positions are implicit: the i-th entry of a row's table holds positions [i P, (i + 1) P), so a
prefix shared by many rows is one run of pages at the head of each of their tables, read by all
and written by none (a row writes only at positions >= its `start`, in pages of its own; the host
copies a shared partial last page before a row writes into it: `copy_pages`).

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
import os
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import cache as kvc
from .. import native
from . import paged_pallas, qarray
from . import recurrence as rec
from . import transformer as tf
from .attention import attention
from .config import ModelConfig
from .kv_modes import KVMode, kv_mode as parse_mode
from .params import Params

PAGE_SIZE = 16  # tokens per page: vLLM's and SGLang's default; see docs/engine-plan.md


@struct.dataclass
class PagedKV:
    """A pool of pages (see the module doc): every cache layer of one depth, page-major inside
    each head, in `kv_mode`'s stored arrays."""

    pre: tuple  # tuple[dict[str, Array [lead, NP, P, w]], ...] (local layers: [lead, NL, P, w])
    loop: dict  # dict[str, Array [L, k, lead, NP, P, w]]
    kv_mode: KVMode = struct.field(pytree_node=False)
    post: tuple = ()
    # The pre blocks with a window of their own kept in local slots (see `local_map`), and each
    # page's slot (-1: none); () and None: every layer on the pages themselves.
    slot_of: jax.Array | None = None  # int32 [NP]
    local: tuple = struct.field(pytree_node=False, default=())

    def __post_init__(self):
        object.__setattr__(self, "kv_mode", parse_mode(self.kv_mode))
        object.__setattr__(self, "local", tuple(int(j) for j in self.local))

    @property
    def _any(self) -> jax.Array:
        return next(iter(self.loop.values()))

    @property
    def n_pages(self) -> int:
        return int(self._any.shape[-3])

    @property
    def page_size(self) -> int:
        return int(self._any.shape[-2])

    @property
    def passes(self) -> int:
        return int(self._any.shape[0])

    @property
    def n_local(self) -> int:
        """Local slots (the pages when there are no local layers)."""
        return int(next(iter(self.pre[self.local[0]].values())).shape[-3]) if self.local else self.n_pages

    def map_of(self, j: int) -> jax.Array | None:
        """Pre layer j's page -> slot map (None: it is stored on the pages)."""
        return self.slot_of if j in self.local else None

    @property
    def nbytes(self) -> int:
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))


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


# ---- the pool ----------------------------------------------------------------------------------

def page_nbytes(kv_mode: str | KVMode, n_layers: int, n_kv_heads: int, page_size: int, head_dim: int,
                d_model: int) -> int:
    """Bytes of one page of n_layers cache layers."""
    return n_layers * parse_mode(kv_mode).layer_nbytes(n_kv_heads, page_size, head_dim, d_model)


def page_shapes(mode: KVMode, n_kv_heads: int, n_pages: int, page_size: int, head_dim: int, d_model: int) -> dict:
    """One layer's stored arrays as pages: name -> ([lead, NP, P, w], dtype)."""
    out = {}
    for n, ((lead, _, w), d) in mode.layer_shapes(n_kv_heads, n_pages * page_size, head_dim, d_model).items():
        out[n] = ((lead, n_pages, page_size, w), d)
    return out


def local_layers(cfg: ModelConfig) -> tuple:
    """The pre blocks with a window of their own (Gemma's local layers), which caches may keep to
    their window (dense rings, local slots). `TINYLOOP_LAYER_RINGS=0`: none (every layer keeps
    the whole context: a benchmark's other arm)."""
    if os.environ.get("TINYLOOP_LAYER_RINGS", "1") == "0":
        return ()
    return tuple(j for j in range(cfg.n_pre_blocks) if cfg.block_window(j) > 0)


def local_window(cfg: ModelConfig, cache_window: int = 0) -> int:
    """The most positions a local layer looks back over (a call's cache_window, if smaller;
    0: no local layers)."""
    need = [cfg.block_window(j) for j in local_layers(cfg)]
    return max((w if cache_window <= 0 else min(w, cache_window) for w in need), default=0)


def empty(cfg: ModelConfig, passes: int, n_pages: int, page_size: int = PAGE_SIZE, kv_mode=None,
          n_local: int | None = None) -> PagedKV:
    """A pool of n_pages zeroed pages for `cfg`'s layers at depth `passes`, in cfg's kv_mode (or
    `kv_mode`: a call's working pool, see `block`); with n_local, the pre blocks with a window of
    their own in n_local local slots instead (`local_map`; no page has a slot yet). Out of memory
    is a RuntimeError (checked before anything is allocated)."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two")
    mode = cfg.storage if kv_mode is None else parse_mode(kv_mode)
    layers, local = cfg.n_cache_layers(passes), (local_layers(cfg) if n_local is not None else ())
    size = lambda n, k: n * page_nbytes(mode, k, cfg.n_kv_heads, page_size, cfg.head_dim, cfg.d_model)  # noqa: E731
    need = size(n_pages, layers - len(local)) + (size(n_local, len(local)) if local else 0)
    kvc.check_fits(need, f"a page pool of {n_pages} pages x {page_size} tokens x {layers} layers ({mode})")
    shapes = page_shapes(mode, cfg.n_kv_heads, n_pages, page_size, cfg.head_dim, cfg.d_model)
    slots = page_shapes(mode, cfg.n_kv_heads, n_local, page_size, cfg.head_dim, cfg.d_model) if local else shapes
    layer = lambda lead=(), sh=shapes: {n: jnp.zeros(lead + s, d) for n, (s, d) in sh.items()}  # noqa: E731
    pre = tuple(layer(sh=slots if j in local else shapes) for j in range(cfg.n_pre_blocks))
    return placed(PagedKV(pre=pre, loop=layer((passes, cfg.loop_blocks)), kv_mode=mode,
                          post=tuple(layer() for _ in range(cfg.n_post_blocks)),
                          slot_of=jnp.full((n_pages,), -1, jnp.int32) if local else None, local=local), cfg.mesh)


def local_map(slot_of: jax.Array | None, pages: jax.Array, n_slots: int, write: bool = False) -> jax.Array:
    """Page ids -> the local slots holding a local layer's K/V for them (`PagedKV.slot_of`; None:
    the pages themselves). A page without a slot reads slot 0 (only pages outside every query's
    window lose theirs: masked) and its writes, like those past the pool, are dropped."""
    if slot_of is None:
        return pages
    n = slot_of.shape[0]
    slot = jnp.where(pages < n, slot_of[jnp.clip(pages, 0, n - 1)], -1)
    return jnp.where(slot >= 0, slot, n_slots) if write else jnp.maximum(slot, 0)


def placed(pool: PagedKV, mesh) -> PagedKV:
    """The pool laid out on a ('data', 'model') mesh (inside a program: a sharding constraint):
    every page split by KV heads over 'model' (h modes store h, no head axis: replicated),
    whole on every 'data' row group (any row may read any page). None: as it is."""
    if mesh is None:
        return pool
    from jax.sharding import NamedSharding

    from . import sharding

    heads = pool.kv_mode.splits_heads

    def put(a, head_axis):
        spec = sharding.cache_spec(a.shape, False, head_axis if heads else None, mesh)
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))
    layer = lambda e: {n: put(a, 0) for n, a in e.items()}  # noqa: E731
    return pool.replace(pre=tuple(map(layer, pool.pre)), post=tuple(map(layer, pool.post)),
                        loop={n: put(a, 2) for n, a in pool.loop.items()})


def over_data(x: jax.Array, mesh) -> jax.Array:
    """The step's token streams [N, D] split over 'data' (rows of a batch on their devices;
    GSPMD carries the split through the blocks), when 'data' divides N."""
    if mesh is None or x.shape[0] % mesh.shape["data"]:
        return x
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec("data", None)))


def copy_pages(pool: PagedKV, src: jax.Array, dst: jax.Array) -> PagedKV:
    """Pages dst [n] <- pages src [n], every layer (copy-on-write of a shared partial page; a
    local layer copies their slots)."""
    def cp(layer, m=None):  # [.., lead, NP, P, w]
        s, d = local_map(m, src, 0), local_map(m, dst, _slots(layer), write=True)
        return {n: a.at[..., d, :, :].set(a[..., s, :, :], mode="drop") for n, a in layer.items()}
    return pool.replace(pre=tuple(cp(e, pool.map_of(j)) for j, e in enumerate(pool.pre)), loop=cp(pool.loop),
                        post=tuple(map(cp, pool.post)))


def _slots(layer: dict) -> int:
    return int(next(iter(layer.values())).shape[-3])


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


def write(store: dict, fresh: dict, page: jax.Array, off: jax.Array, index=None) -> dict:
    """The step's stored arrays fresh {name: [lead, N, w]} written at (page [N], off [N]) of one
    layer (page >= NP: dropped). One scatter per array, in place."""
    if index is None:
        return {n: a.at[:, page, off].set(fresh[n].astype(a.dtype), mode="drop") for n, a in store.items()}
    t, j = index  # advanced indices split by the head slice: the update is [N, lead, w]
    return {n: a.at[t, j, :, page, off].set(fresh[n].astype(a.dtype).transpose(1, 0, 2), mode="drop")
            for n, a in store.items()}


def read(store: dict, index=None) -> dict:
    """One layer's page arrays [lead, NP, P, w]."""
    return kvc.read(store, index)


def gather(layer: dict, pages: jax.Array) -> dict:
    """A row's context: layer {name: [lead, NP, P, w]}, its page table pages [R] ->
    {name: [lead, R P, w]}, position i at slot i."""
    def take(a):
        g = jnp.take(a, pages, axis=1)  # [lead, R, P, w]
        return g.reshape(g.shape[0], -1, g.shape[-1])
    return {n: take(a) for n, a in layer.items()}


def row_attention(cfg: ModelConfig, blk, layer: dict, q: jax.Array, q_pos: jax.Array, pages: jax.Array,
                  length: jax.Array, window, mode: KVMode | None = None) -> jax.Array:
    """The XLA reference of paged attention for one row: q [H, T, hd] at q_pos [T] over its
    pages [R] of layer (positions < length are live; window: static, or the row's traced; mode:
    the pool's, default the model's) -> [H, T, hd]. Any backend."""
    stored = gather(layer, pages)
    key_pos = jnp.arange(pages.shape[0] * next(iter(layer.values())).shape[2], dtype=jnp.int32)
    k, v = tf.read_kv(cfg, stored, blk, mode or cfg.storage, key_pos)  # h modes: K/V rebuilt, K rotated at key_pos
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
    want = os.environ.get("TINYLOOP_PAGED_KERNEL", "auto")
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
          mode: KVMode | None = None, slot_of: jax.Array | None = None):
    """One transformer block on the step's streams x [N, D] (the groups' tokens one after
    another): the step's K/V written into the pages, then each row's queries attend to the row's
    pages. mode: the pool's (default the model's; a call's working pool of an h mode holds
    float32 K/V, written as the model's mode would give them when read back). slot_of: a local
    layer's page -> slot map (`local_map`). Returns (x', store)."""
    pos = jnp.concatenate([g.pos.reshape(-1) for g in groups])
    window = tf.layer_window(window, blk)
    h, q, k, v = tf.qkv_heads(x, blk, cfg, pos)
    page = local_map(slot_of, jnp.concatenate([g.page for g in groups]), _slots(store), write=True)
    off = jnp.concatenate([g.off for g in groups])
    mode = cfg.storage if mode is None else mode
    fresh = cfg.storage.pack(h, k, v)
    if mode != cfg.storage:  # results must not depend on where a token is kept
        fresh = mode.pack(h, *tf.read_kv(cfg, fresh, blk, cfg.storage, pos))
    store = write(store, fresh, page, off, index)
    H, _, hd = q.shape
    q = q.astype(jnp.float32)
    kernel = attention_kernel(cfg, mode)
    layer = None if kernel != "xla" else read(store, index)
    outs, at = [], 0
    for g in groups:
        b, T = g.pos.shape
        table = local_map(slot_of, g.rows.pages, 0)
        qg = q[:, at:at + b * T].reshape(H, b, T, hd).transpose(1, 0, 2, 3)  # [b, H, T, hd]
        rows_window = None if g.rows.window is None else tf.layer_window(g.rows.window, blk)
        win = jnp.full((b,), window, jnp.int32) if rows_window is None else rows_window  # [b]
        if kernel != "xla":  # the stack itself and the layer's index: no copy of the layer
            i = 0 if index is None else index[0] * len(cfg_loop(store)) + index[1]
            run = (native.paged_attention if kernel == "native" else
                   functools.partial(paged_pallas.paged_attention, interpret=kernel == "interpret"))
            a = run((qg * hd ** -0.5).transpose(0, 2, 1, 3), store["k"], store["v"], store.get("ks"),
                    store.get("vs"), table, g.rows.start, g.rows.n_new, jnp.asarray(i, jnp.int32),
                    mode.format.name, win, cfg.n_kv_heads).transpose(0, 2, 1, 3)
        else:  # each row's own window (traced), or the step's
            w = win if rows_window is not None else jnp.full((b,), -1, jnp.int32)
            a = jax.vmap(lambda q_, p_, t_, n_, w_: row_attention(
                cfg, blk, layer, q_, p_, t_, n_, window if rows_window is None else w_, mode))(
                    qg, g.pos, table, g.length, w)
        outs.append(a.transpose(1, 0, 2, 3).reshape(H, b * T, hd))
        at += b * T
    return tf.block_out(x, jnp.concatenate(outs, axis=1), blk, cfg), store


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


@tf.exact
def forward(params: Params, cfg: ModelConfig, pool: PagedKV, rows, tokens, loops: int, window: int,
            exit: tf.Exit | None = None, seeds=None, keep_state: bool = False):
    """One step: groups of rows, each `Rows` [b, R] with its tokens [b, T] (row i's first
    n_new[i] real, at positions start[i] + t), through every layer at depth `loops`, their K/V
    written into the rows' pages. `rows`, `tokens` (and `seeds`: [b] uint32 each, the injection
    models' initial states; None: 0) are one group or tuples of groups. Returns (the streams the
    logits come from, [b, T, D] per group (a tuple for tuples), the pool); keep_state: also the
    streams after the last pass (before the coda; injection models: the loop state), the same way."""
    single = isinstance(rows, Rows)
    rows, tokens = as_groups(rows, tokens)
    if pool.passes < loops:
        raise ValueError(f"a pool of {pool.passes} passes cannot run loops={loops}")
    groups = tuple(Group.of(r, t.shape[1], pool) for r, t in zip(rows, tokens))
    pos = jnp.concatenate([g.pos.reshape(-1) for g in groups])
    x = over_data(embed(params, jnp.concatenate([t.reshape(-1) for t in tokens]), pos, cfg), cfg.mesh)
    inject = rec.injected(cfg)
    if inject and cfg.embed_scale != 1.0:
        x = x * cfg.embed_scale

    pre = []
    for j, (blk, store) in enumerate(zip(params.pre, pool.pre)):
        x, store = block(x, blk, cfg, groups, store, None, window, pool.kv_mode, pool.map_of(j))
        pre.append(store)
    e = None
    if inject:
        seeds = (seeds,) if single else (seeds or (None,) * len(groups))
        states = []
        for g, sd in zip(groups, seeds):
            sd = jnp.zeros(g.pos.shape[:1], jnp.uint32) if sd is None else sd
            states.append(jax.vmap(lambda seed, p: rec.initial_state(cfg, seed, p))(sd, g.pos).reshape(g.size, -1))
        e, x = x, over_data(jnp.concatenate(states), cfg.mesh)
    gated = exit is not None and cfg.early_exit_gate

    def one_pass(i, carry):
        x, stack, sel = carry
        if e is not None:
            x = rec.pass_input(params, x, e)
        for j, blk in enumerate(params.loop):
            x, stack = block(x, blk, cfg, groups, stack, (i, j), window, pool.kv_mode)
        if cfg.pass_norm:
            x = tf.final_norm(params, cfg, x)
        if gated:
            sel = tf.exit_update(params, exit, i, i == loops - 1, x, sel)
        return x, stack, sel

    sel = tf.ExitCarry.start(x) if gated else None
    x, loop, sel = jax.lax.fori_loop(0, loops, one_pass, (x, pool.loop, sel))
    y = tf.final_norm(params, cfg, x) if cfg.norm_before_coda else x
    post = []
    for blk, store in zip(params.post, pool.post):
        y, store = block(y, blk, cfg, groups, store, None, window, pool.kv_mode)
        post.append(store)
    pool = placed(pool.replace(pre=tuple(pre), loop=loop, post=tuple(post)), cfg.mesh)
    out = split(sel.pick(x) if gated else y, groups, single)
    return (out, pool, split(x, groups, single)) if keep_state else (out, pool)


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


def load_segment(pool: PagedKV, seg, pages: jax.Array, start: jax.Array, n: jax.Array) -> PagedKV:
    """Positions [start, n) of a dense segment (a `PrefixCache`'s `model.cache.KVCache`: slot s
    holds position seg.pos[s], a window's ring included; a ring layer's slots seg.ring_pos[s])
    written into the pages pages [R] (position p: page pages[p // P]), every layer, stored values
    as they are. A ring layer writes only the positions it holds (the last of its window)."""
    P = pool.page_size

    def where(p):  # the page and offset of each slot's position (outside [start, n): dropped)
        page = jnp.where((p >= start) & (p < n), pages[jnp.clip(p // P, 0, pages.shape[0] - 1)], pool.n_pages)
        return page, jnp.maximum(p, 0) % P
    page, off = where(seg.pos)
    ring = where(seg.ring_pos) if seg.rings else None

    def put(store, layer, at=(page, off), m=None):
        return write(store, layer, local_map(m, at[0], _slots(store), write=True), at[1])
    loop = {k: a.at[:, :, :, page, off].set(seg.loop[k][:a.shape[0]].astype(a.dtype), mode="drop")
            for k, a in pool.loop.items()}
    return pool.replace(pre=tuple(put(a, b, ring if j in seg.rings else (page, off), pool.map_of(j))
                                  for j, (a, b) in enumerate(zip(pool.pre, seg.pre))), loop=loop,
                        post=tuple(put(a, b) for a, b in zip(pool.post, seg.post)))


@jax.jit
def _copy_pages(pool: PagedKV, src: jax.Array, dst: jax.Array) -> PagedKV:
    return copy_pages(pool, src, dst)


def to_segment(pool: PagedKV, pages: jax.Array, n: jax.Array, capacity: int) -> kvc.KVCache:
    """`load_segment`'s inverse: positions [0, n) of the pages pages [R] (position p: page
    pages[p // P]) as a dense segment of `capacity` slots (slot p holds position p; slots >= n
    are empty), every layer, stored values as they are."""
    P = pool.page_size
    slot = jnp.arange(capacity, dtype=jnp.int32)
    page, off = pages[jnp.clip(slot // P, 0, pages.shape[0] - 1)], slot % P

    def take(layer, m=None):  # [.., lead, C, w]
        at = local_map(m, page, 0)
        return {k: a[..., at, off, :] for k, a in layer.items()}
    return kvc.KVCache(pre=tuple(take(s, pool.map_of(j)) for j, s in enumerate(pool.pre)), loop=take(pool.loop),
                       pos=jnp.where(slot < n, slot, -1), length=jnp.asarray(n, jnp.int32), kv_mode=pool.kv_mode,
                       post=tuple(take(s) for s in pool.post))


def grow(pool: PagedKV, n_pages: int) -> PagedKV:
    """The pool with zeroed pages added up to n_pages (the old pages keep their ids)."""
    extra = n_pages - pool.n_pages
    if extra < 0:
        raise ValueError(f"cannot shrink a pool of {pool.n_pages} pages to {n_pages}")
    if pool.local:
        raise ValueError("a pool with local slots does not grow")
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 3) + [(0, extra), (0, 0), (0, 0)])  # noqa: E731
    return jax.tree.map(pad, pool)
