"""The page pool: every cache layer of one depth in pages of P tokens, and its operations that
no forward step runs (allocation, page copies, a dense segment's load and unload, growth).

A pool holds pages of P tokens; a page holds those tokens' stored K/V (or h) in *every* cache
layer of one depth — pre blocks, the L x k loop passes, the coda — so a row's context is one
list of page ids (its page table), the same for every layer:

    pre[j]  = {"k": [KV, NP, P, hd], "v": ...}              one per pre block   (layout: kv_modes)
              or Stacked({"k": [n_pre, KV, NP, P, hd]})     one stack (`model.stack`: a layer loop)
    loop    = {"k": [L, k, KV, NP, P, hd], "v": ...}        L passes of the k loop blocks
    post[j] = like pre[j]                                    one per coda block
    page table of a row: [R] int32; its position p lives in page table[p // P], offset p % P

A model whose pre blocks have windows of their own (Gemma's local layers) may keep those layers
in *local slots* instead (`empty(n_local=)`): their arrays have NL < NP slots, and `slot_of [NP]`
says which slot holds a page's K/V for them (-1: none, for pages outside every query's window);
`local_map` turns a row's table and write targets into slots, so the tables stay the pages'.
The host moves slots with the windows (the engine's `LocalSlots`; `generate`'s pools a static
ring per row). `model.paged` runs the forward step over a pool.

Under a compact `kv_share` the engine's pool keeps two loop stacks: `loop`, the compact store
every page has (`kv_share.slots(loops)` passes: what decode steps read), and `aside`, every pass
in NF < NP *pass slots* (`aside_of [NP]`: a page's slot, -1: none), held by the pages of prompts
in flight and of cached prefixes (a prompt reads and writes every pass). `swap` exchanges the
two (a prompt chunk runs on the swapped pool, its loop layers mapped through the slots as a
local layer's are); `collapse_pages` fills a finished prompt's pages' compact layers from them.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from . import cache as kvc
from .config import ModelConfig
from .stack import Stacked, is_stacked
from .transformer import materialize
from .kv_modes import KVMode, kv_mode as parse_mode
from .. import settings


PAGE_SIZE = 16  # tokens per page: vLLM's and SGLang's default; see docs/engine-plan.md
# page-table entries (and a call's pool pages) of the smallest program, 64 tokens at P = 16: a short
# request's table costs nothing to pad so far, and calls of short prompts share one program
MIN_TABLE = 4


@struct.dataclass
class PagedKV:
    """A pool of pages (see the module doc): every cache layer of one depth, page-major inside
    each head, in `kv_mode`'s stored arrays."""

    # tuple[dict[str, Array [lead, NP, P, w]], ...] (local layers: [lead, NL, P, w]), or one
    # Stacked({name: [n_pre, lead, NP, P, w]}) that a step runs in a layer loop (index (i,))
    pre: tuple | Stacked
    loop: dict  # dict[str, Array [L, k, lead, NP, P, w]]
    kv_mode: KVMode = struct.field(pytree_node=False)
    post: tuple = ()
    # The pre blocks with a window of their own kept in local slots (see `local_map`), and each
    # page's slot (-1: none); () and None: every layer on the pages themselves.
    slot_of: jax.Array | None = None  # int32 [NP]
    local: tuple = struct.field(pytree_node=False, default=())
    # `kv_share`: "full" (the loop stack holds every pass), or the compact store of finished
    # tokens (`kv_share.collapse`: its leading axis the mode's slots; decode steps only)
    share: object = struct.field(pytree_node=False, default="full")
    # the loop stack's page -> slot map (None: the pages themselves; the swapped pool's pass slots)
    loop_of: jax.Array | None = None
    # the other loop stack of an engine's compact pool (module doc), its map and its kv_share
    aside: dict | None = None
    aside_of: jax.Array | None = None
    aside_share: object = struct.field(pytree_node=False, default="full")

    def __post_init__(self):
        from .kv_share import parse

        object.__setattr__(self, "kv_mode", parse_mode(self.kv_mode))
        object.__setattr__(self, "local", tuple(int(j) for j in self.local))
        object.__setattr__(self, "share", parse(self.share))
        object.__setattr__(self, "aside_share", parse(self.aside_share))

    @property
    def _any(self) -> jax.Array:
        return next(iter(self.loop.values()))

    @property
    def n_pages(self) -> int:
        return int(self._any.shape[-3] if self.loop_of is None else self.loop_of.shape[0])

    @property
    def n_prompt(self) -> int:
        """Pass slots (0: none, the pool is not an engine's compact one)."""
        return 0 if self.aside is None else int(next(iter(self.aside.values())).shape[-3])

    @property
    def page_size(self) -> int:
        return int(self._any.shape[-2])

    @property
    def passes(self) -> int:
        """Passes held (a compact store: its slots)."""
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
    if settings.get("TINYLOOP_LAYER_RINGS") == "0":
        return ()
    return tuple(j for j in range(cfg.n_pre_blocks) if cfg.block_window(j) > 0)


def local_window(cfg: ModelConfig, cache_window: int = 0) -> int:
    """The most positions a local layer looks back over (a call's cache_window, if smaller;
    0: no local layers)."""
    need = [cfg.block_window(j) for j in local_layers(cfg)]
    return max((w if cache_window <= 0 else min(w, cache_window) for w in need), default=0)


def empty(cfg: ModelConfig, passes: int, n_pages: int, page_size: int = PAGE_SIZE, kv_mode=None,
          n_local: int | None = None, n_prompt: int | None = None) -> PagedKV:
    """A pool of n_pages zeroed pages for `cfg`'s layers at depth `passes`, in cfg's kv_mode (or
    `kv_mode`: a call's working pool, see `block`); with n_local, the pre blocks with a window of
    their own in n_local local slots instead (`local_map`; no page has a slot yet); with
    n_prompt (a compact `cfg.kv_share`), the engine's compact pool: the loop layers compact on
    every page and every pass in n_prompt pass slots (module doc; no page has one yet). Out of
    memory is a RuntimeError (checked before anything is allocated)."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two")
    mode = cfg.storage if kv_mode is None else parse_mode(kv_mode)
    share = cfg.share if n_prompt is not None else None
    if share is not None and share.full:
        raise ValueError("pass slots (n_prompt) are for a compact kv_share; this model's is 'full'")
    held = passes if share is None else share.slots(passes)
    layers, local = cfg.n_cache_layers(held), (local_layers(cfg) if n_local is not None else ())
    size = lambda n, k: n * page_nbytes(mode, k, cfg.n_kv_heads, page_size, cfg.head_dim, cfg.d_model)  # noqa: E731
    need = size(n_pages, layers - len(local)) + (size(n_local, len(local)) if local else 0)
    need += size(n_prompt, passes * cfg.loop_blocks) if share is not None else 0
    kvc.check_fits(need, f"a page pool of {n_pages} pages x {page_size} tokens x {layers} layers ({mode})")
    shapes = page_shapes(mode, cfg.n_kv_heads, n_pages, page_size, cfg.head_dim, cfg.d_model)
    slots = page_shapes(mode, cfg.n_kv_heads, n_local, page_size, cfg.head_dim, cfg.d_model) if local else shapes
    layer = lambda lead=(), sh=shapes: {n: jnp.zeros(lead + s, d) for n, (s, d) in sh.items()}  # noqa: E731
    if not local and cfg.mesh is None and cfg.n_pre_blocks > 1:  # one stack: a step runs it in a loop
        pre = Stacked(layer((cfg.n_pre_blocks,)))
    else:
        pre = tuple(layer(sh=slots if j in local else shapes) for j in range(cfg.n_pre_blocks))
    aside = {} if share is None else dict(
        aside=layer((passes, cfg.loop_blocks), page_shapes(mode, cfg.n_kv_heads, n_prompt, page_size, cfg.head_dim,
                                                           cfg.d_model)),
        aside_of=jnp.full((n_pages,), -1, jnp.int32), share=share)
    return placed(PagedKV(pre=pre, loop=layer((held, cfg.loop_blocks)), kv_mode=mode,
                          post=tuple(layer() for _ in range(cfg.n_post_blocks)),
                          slot_of=jnp.full((n_pages,), -1, jnp.int32) if local else None, local=local, **aside),
                  cfg.mesh)


def swap(pool: PagedKV) -> PagedKV:
    """An engine's compact pool with its two loop stacks exchanged (module doc): the pass slots'
    stack read and written by a prompt chunk (mapped by `loop_of`), the compact one aside; and
    back. A host-side relabelling: no device work."""
    if pool.aside is None:
        raise ValueError("the pool keeps no second loop stack (not an engine's compact pool)")
    return pool.replace(loop=pool.aside, loop_of=pool.aside_of, share=pool.aside_share,
                        aside=pool.loop, aside_of=pool.loop_of, aside_share=pool.share)


def collapse_pages(pool: PagedKV, pages: jax.Array, loops: int) -> PagedKV:
    """The pages pages [n] (a finished prompt's; past the pool: ignored) of an engine's compact
    pool: their compact loop layers filled from their pass slots (`kv_share.collapse`). The same
    passes give the same values, so a page shared by two prompts may be filled by either."""
    from . import kv_share

    if pool.aside is None or pool.loop_of is not None:
        raise ValueError("collapse_pages takes an engine's compact pool (not swapped)")
    src = local_map(pool.aside_of, pages, 0)
    stack = {n: a[:, :, :, src] for n, a in pool.aside.items()}  # [loops, k, lead, n, P, w]
    compact = kv_share.collapse(stack, pool.share, loops, pool.kv_mode)
    dst = jnp.where(pages < pool.n_pages, pages, pool.n_pages)
    return pool.replace(loop={n: a.at[:, :, :, dst].set(compact[n].astype(a.dtype), mode="drop")
                              for n, a in pool.loop.items()})


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
    if is_stacked(pool.pre):
        raise ValueError("a pool with stacked pre layers is for one device")
    layer = lambda e: {n: put(a, 0) for n, a in e.items()}  # noqa: E731
    stack = lambda e: None if e is None else {n: put(a, 2) for n, a in e.items()}  # noqa: E731
    return pool.replace(pre=tuple(map(layer, pool.pre)), post=tuple(map(layer, pool.post)),
                        loop=stack(pool.loop), aside=stack(pool.aside))


def copy_pages(pool: PagedKV, src: jax.Array, dst: jax.Array) -> PagedKV:
    """Pages dst [n] <- pages src [n], every layer (copy-on-write of a shared partial page; a
    local layer copies their slots, an engine's compact pool its pass slots too)."""
    def cp(layer, m=None):  # [.., lead, NP, P, w]
        s, d = local_map(m, src, 0), local_map(m, dst, layer_slots(layer), write=True)
        return {n: a.at[..., d, :, :].set(a[..., s, :, :], mode="drop") for n, a in layer.items()}
    return pool.replace(pre=Stacked(cp(pool.pre.tree)) if is_stacked(pool.pre) else
                        tuple(cp(e, pool.map_of(j)) for j, e in enumerate(pool.pre)),
                        loop=cp(pool.loop, pool.loop_of), post=tuple(map(cp, pool.post)),
                        aside=None if pool.aside is None else cp(pool.aside, pool.aside_of))


def layer_slots(layer: dict) -> int:
    return int(next(iter(layer.values())).shape[-3])


# ---- reading and writing one layer ------------------------------------------------------------
# A layer's store is a pre/coda layer ({name: [lead, NP, P, w]}, index None), the loop stack
# ({name: [L, k, lead, NP, P, w]}) at index (pass t, traced; loop block j, static), or the pre
# blocks' stack ({name: [n, lead, NP, P, w]}) at index (layer i,).

def write(store: dict, fresh: dict, page: jax.Array, off: jax.Array, index=None) -> dict:
    """The step's stored arrays fresh {name: [lead, N, w]} written at (page [N], off [N]) of one
    layer (page >= NP: dropped). One scatter per array, in place."""
    if index is None:
        return {n: a.at[:, page, off].set(fresh[n].astype(a.dtype), mode="drop") for n, a in store.items()}
    # advanced indices split by the head slice: the update is [N, lead, w]
    return {n: a.at[(*index, slice(None), page, off)].set(fresh[n].astype(a.dtype).transpose(1, 0, 2), mode="drop")
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


def load_segment(pool: PagedKV, seg, pages: jax.Array, start: jax.Array, n: jax.Array, params=None,
                 cfg: ModelConfig | None = None) -> PagedKV:
    """Positions [start, n) of a dense segment (a `PrefixCache`'s `model.cache.KVCache`: slot s
    holds position seg.pos[s], a window's ring included; a ring layer's slots seg.ring_pos[s])
    written into the pages pages [R] (position p: page pages[p // P]), every layer, stored values
    as they are. A ring layer writes only the positions it holds (the last of its window); an
    engine's compact pool, its pass slots (a prompt's: every pass). A segment stored in another
    mode than the pool's (an h mode's streams into a call's float32 pool) has its K/V rebuilt on
    the way, in the same program (`transformer.materialize`: the model's params and cfg)."""
    if pool.aside is not None and pool.loop_of is None:
        return swap(load_segment(swap(pool), seg, pages, start, n, params, cfg))
    if seg.kv_mode != pool.kv_mode:
        if cfg is None:
            raise ValueError(f"a {seg.kv_mode} segment into a {pool.kv_mode} pool is rebuilt: pass params and cfg")
        seg = materialize(params, cfg, seg, passes=pool.passes)
    P = pool.page_size

    def where(p):  # the page and offset of each slot's position (outside [start, n): dropped)
        page = jnp.where((p >= start) & (p < n), pages[jnp.clip(p // P, 0, pages.shape[0] - 1)], pool.n_pages)
        return page, jnp.maximum(p, 0) % P
    page, off = where(seg.pos)
    ring = where(seg.ring_pos) if seg.rings else None

    def put(store, layer, at=(page, off), m=None):
        return write(store, layer, local_map(m, at[0], layer_slots(store), write=True), at[1])
    lp = local_map(pool.loop_of, page, layer_slots(pool.loop), write=True)
    loop = {k: a.at[:, :, :, lp, off].set(seg.loop[k][:a.shape[0]].astype(a.dtype), mode="drop")
            for k, a in pool.loop.items()}
    if is_stacked(pool.pre):  # (no local slots: every layer on the pages)
        pre = pool.pre.tree
        for j, b in enumerate(seg.pre):
            pre = write(pre, b, *(ring if j in seg.rings else (page, off)), (j,))
        pre = Stacked(pre)
    else:
        pre = tuple(put(a, b, ring if j in seg.rings else (page, off), pool.map_of(j))
                    for j, (a, b) in enumerate(zip(pool.pre, seg.pre)))
    return pool.replace(pre=pre, loop=loop, post=tuple(put(a, b) for a, b in zip(pool.post, seg.post)))


@jax.jit
def _copy_pages(pool: PagedKV, src: jax.Array, dst: jax.Array) -> PagedKV:
    return copy_pages(pool, src, dst)


def to_segment(pool: PagedKV, pages: jax.Array, n: jax.Array, capacity: int, rings: tuple = (),
               ring_capacity: int = 0) -> kvc.KVCache:
    """`load_segment`'s inverse: positions [0, n) of the pages pages [R] (position p: page
    pages[p // P]) as a dense segment of `capacity` slots, every layer, stored values as they
    are. Slot s holds the last position < n that lands in it (p mod capacity = s: all of them
    when capacity >= n, else the last `capacity`, a window's ring); the pre layers `rings` hold
    ring_capacity slots the same way (`cache.ring_plan`). Empty slots are zeros, whatever the
    pages past the row hold."""
    P = pool.page_size

    def plan(C: int):  # each slot's position, page and offset, and whether it holds one
        s = jnp.arange(C, dtype=jnp.int32)
        p = s + C * ((n - 1 - s) // C)
        live = p >= 0
        return pages[jnp.clip(p // P, 0, pages.shape[0] - 1)], jnp.maximum(p, 0) % P, live, jnp.where(live, p, -1)

    full = plan(capacity)
    ring = plan(ring_capacity) if rings else None

    def take(layer, how, m=None):  # [.., lead, C, w]
        page, off, live, _ = how
        at = local_map(m, page, 0)
        return {k: jnp.where(live[:, None], a[..., at, off, :], jnp.zeros((), a.dtype)) for k, a in layer.items()}
    maps = [None] * len(pool.pre) if is_stacked(pool.pre) else [pool.map_of(j) for j in range(len(pool.pre))]
    pre = tuple(take(layer, ring if j in rings else full, m) for j, (layer, m) in enumerate(zip(pool.pre, maps)))
    return kvc.KVCache(pre=pre, loop=take(pool.loop, full), pos=full[3], length=jnp.asarray(n, jnp.int32),
                       kv_mode=pool.kv_mode, post=tuple(take(s, full) for s in pool.post),
                       ring_pos=ring[3] if rings else None, rings=tuple(rings) if rings else ())


def grow(pool: PagedKV, n_pages: int) -> PagedKV:
    """The pool with zeroed pages added up to n_pages (the old pages keep their ids)."""
    extra = n_pages - pool.n_pages
    if extra < 0:
        raise ValueError(f"cannot shrink a pool of {pool.n_pages} pages to {n_pages}")
    if pool.local or pool.aside is not None:
        raise ValueError("a pool with local or pass slots does not grow")
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 3) + [(0, extra), (0, 0), (0, 0)])  # noqa: E731
    return jax.tree.map(pad, pool)
