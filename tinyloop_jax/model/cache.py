"""The KV cache: an immutable pytree of fixed-capacity buffers, the loop's passes stacked.

One `KVCache` is one *segment* of a sequence's attention context. A plain generation has one
segment; a request served from a prefix reads the prefix's segment (never written) and
writes only its own:

    prefix segment (read-only, shared)        own segment (per request, written)
    ┌─────────────────────────────┐           ┌──────────────────────┐
    │ pos 0 .. P-1                │           │ pos P .. P+n-1       │
    └─────────────────────────────┘           └──────────────────────┘

    pre[j]   = {"k": [KV, C, hd], "v": [KV, C, hd]}          one per pre block  (fp modes; see kv_modes)
    loop     = {"k": [L, k, KV, C, hd], "v": [L, k, KV, C, hd]} L passes of the k loop blocks
    post[j]  = like pre[j]                                    one per coda block (after the loop)
    pos      = [C] int32: absolute position held by each slot, -1 = empty
    length   = []  int32: one past the last position written
    rings    = pre blocks with a window of their own (Gemma's local layers), sized by it:
    ring_pos = [Cw] int32: the positions their Cw < C slots hold (None: no such layers)

Cache layer n_pre + t * k + j is pass t, loop block j: `loop[n][t, j]`; the coda's layers come
last. Coda K/V depend on the depth the loop ran to, so they belong to one depth. Stacking the passes
makes depth data, not program size: a program runs the passes with `lax.fori_loop` over the
leading axis, and a depth d <= L reads the first d passes of the same arrays (no copy). K/V are
stored per key/value head (KV = n_kv_heads), so grouped-query models hold n_heads / KV times
less. A batch of segments (one per request) has a leading request axis on every array.

Slot of position p is `p % C`. A contiguous run of at most C positions never collides, so the
same rule serves a full cache (C >= tokens) and a sliding-window ring buffer (C >= W: old
positions are overwritten, and attention masks by position anyway). A pre block with a window
of its own holds only a ring of Cw >= W slots when the segment is longer (`ring_plan`): its
layer reads `ring_pos` instead of `pos` (`pre_pos`).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import sharding
from .kv_modes import KVMode, kv_mode as parse_mode
from .. import settings


@struct.dataclass
class KVCache:
    pre: tuple  # tuple[dict[str, Array [.., lead, C, w]], ...], one per pre block
    loop: dict  # dict[str, Array [.., L, k, lead, C, w]]: the loop's passes
    pos: jax.Array  # [.., C] int32
    length: jax.Array  # [..] int32
    kv_mode: KVMode = struct.field(pytree_node=False)  # a mode name is parsed on construction
    post: tuple = ()  # tuple[dict, ...], one per coda block
    ring_pos: jax.Array | None = None  # [.., Cw] int32: the ring layers' positions (None: no ring)
    rings: tuple = struct.field(pytree_node=False, default=())  # pre blocks holding Cw slots

    def __post_init__(self):
        object.__setattr__(self, "kv_mode", parse_mode(self.kv_mode))
        object.__setattr__(self, "rings", tuple(int(j) for j in self.rings))
        if bool(self.rings) != (self.ring_pos is not None):
            raise ValueError(f"rings={self.rings} and ring_pos must come together")

    @property
    def capacity(self) -> int:
        return int(self.pos.shape[-1])

    @property
    def ring_capacity(self) -> int:
        """Slots of the ring layers (the capacity when there are none)."""
        return self.capacity if self.ring_pos is None else int(self.ring_pos.shape[-1])

    def pre_pos(self, j: int) -> jax.Array:
        """The positions pre layer j's slots hold."""
        return self.ring_pos if j in self.rings else self.pos

    @property
    def passes(self) -> int:
        """Loop passes held (a program may read only the first few)."""
        return int(next(iter(self.loop.values())).shape[-5])

    @property
    def loop_blocks(self) -> int:
        return int(next(iter(self.loop.values())).shape[-4])

    @property
    def n_layers(self) -> int:
        return len(self.pre) + self.passes * self.loop_blocks + len(self.post)

    @property
    def nbytes(self) -> int:
        return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self)))

    def layer(self, i: int) -> dict:
        """Cache layer i's arrays (pre block i, or pass t, loop block j with i = n_pre + t k + j),
        unbatched segments only."""
        n, m = len(self.pre), len(self.pre) + self.passes * self.loop_blocks
        if i < n:
            return dict(self.pre[i])
        if i >= m:
            return dict(self.post[i - m])
        t, j = divmod(i - n, self.loop_blocks)
        return {k: a[t, j] for k, a in self.loop.items()}


# ---- sizes and allocation --------------------------------------------------------------------

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Capacity/length bucket for n: powers of two up to 128, then multiples of 128. Few
    distinct shapes (few compiles) while padding wastes at most 127 tokens on long prompts."""
    n = max(int(n), 1)
    if n > 128:
        return -(-n // 128) * 128
    return max(minimum, 1 << (n - 1).bit_length())


EXIT_BLOCK = 64  # positions of a prompt exiting in prefill that a pass runs at once


def exit_length(n: int) -> int:
    """The padded length of a prompt of n tokens that exits as a whole (exit_in_prefill) in a
    `generate` call: whole blocks of EXIT_BLOCK positions (`paged_adaptive.forward(block=...)`),
    a power of two of them up to 128 blocks, then multiples of 128. The engine pads such a
    prompt to one of a few lengths instead (`serving.plan.Plan.exit_lengths`), each one program
    for every prompt up to it."""
    return EXIT_BLOCK * bucket(-(-max(int(n), 1) // EXIT_BLOCK), minimum=1)


def segment_capacity(n_tokens: int, cache_window: int) -> int:
    """Slots needed to hold `n_tokens` positions, or only the last `cache_window` of them."""
    need = n_tokens if cache_window <= 0 else min(n_tokens, cache_window)
    return bucket(max(need, 1))


def cache_nbytes(kv_mode: str | KVMode, n_layers: int, n_kv_heads: int, capacity: int, head_dim: int,
                 d_model: int | None = None, rings: int = 0, ring_capacity: int = 0) -> int:
    """Bytes of a segment of n_layers cache layers, `rings` of them of ring_capacity slots
    (d_model, the width h modes store, defaults to n_kv_heads * head_dim)."""
    d_model = n_kv_heads * head_dim if d_model is None else d_model
    size = lambda c: parse_mode(kv_mode).layer_nbytes(n_kv_heads, c, head_dim, d_model)  # noqa: E731
    ring = rings * size(ring_capacity) + ring_capacity * 4 if rings else 0
    return (n_layers - rings) * size(capacity) + ring + capacity * 4 + 4


def ring_plan(windows, n_tokens: int, cache_window: int = 0, spare: int = 0) -> tuple[tuple, int]:
    """Which pre layers hold a ring of their own, and its slots: windows, each pre block's own
    window (0: none); a segment for n_tokens positions (or the last cache_window of them). A
    block with a window needs only its last W (the call's window, if smaller) plus `spare`
    (positions written ahead and rolled back); when that is no smaller than the segment, every
    layer keeps the segment's slots: ((), 0)."""
    need = {j: w if cache_window <= 0 else min(w, cache_window) for j, w in enumerate(windows) if w > 0}
    if not need:
        return (), 0
    ring = bucket(min(n_tokens, max(need.values()) + spare))
    return (tuple(need), ring) if ring < segment_capacity(n_tokens, cache_window) else ((), 0)


def holds(seg: KVCache, k: int, cache_window: int, ring_window: int) -> bool:
    """Host check: can seg's first k positions be continued (`functional.extend_prefix`)? Every layer must
    still hold the last cache_window of them (0: all), its ring layers the last ring_window."""
    def has(pos, w):
        held = set(np.asarray(jax.device_get(pos)).reshape(-1).tolist())
        return all(p in held for p in range(max(0, k - w) if w > 0 else 0, k))
    return has(seg.pos, cache_window) and (seg.ring_pos is None or has(seg.ring_pos, ring_window))


def free_bytes() -> int | None:
    """Memory the backend can still hand out (`settings.free_bytes`)."""
    return settings.free_bytes()


def check_fits(need: int, what: str) -> None:
    """RuntimeError if `need` bytes cannot be allocated now: checked before anything is
    allocated or compiled, so nothing is half-built (and the host is not pushed into swap)."""
    free = free_bytes()
    if free is not None and need > free:
        raise RuntimeError(f"out of memory: {what} needs {need / 2**20:.1f} MiB but only {free / 2**20:.1f} MiB "
                           "is free; shorten the prompt, lower loops, or set cache_window")


def empty(kv_mode: str | KVMode, n_pre: int, passes: int, n_kv_heads: int, capacity: int, head_dim: int,
          batch: int | None = None, loop_blocks: int = 1, d_model: int | None = None, n_post: int = 0,
          mesh=None, rings: tuple = (), ring_capacity: int = 0) -> KVCache:
    """A fresh segment of n_pre pre layers, `passes` passes of `loop_blocks` layers and n_post
    coda layers (with `batch`: one per request, every array with a leading request axis); the
    pre layers in `rings` hold ring_capacity slots (`ring_plan`). With a mesh, every array is
    allocated in its shards (`sharding.cache_spec`). Out of memory is a RuntimeError."""
    mode = parse_mode(kv_mode)
    lead = () if batch is None else (batch,)
    d_model = n_kv_heads * head_dim if d_model is None else d_model
    layers = n_pre + passes * loop_blocks + n_post
    rings = tuple(rings) if ring_capacity else ()
    check_fits(cache_nbytes(kv_mode, layers, n_kv_heads, capacity, head_dim, d_model, len(rings), ring_capacity)
               * (batch or 1), f"a KV cache of {layers} layers x {capacity} slots ({kv_mode})")
    shapes = mode.layer_shapes(n_kv_heads, capacity, head_dim, d_model)
    ring_shapes = mode.layer_shapes(n_kv_heads, ring_capacity, head_dim, d_model) if rings else shapes

    def zeros(shape, dtype, head_axis=None, fill=0):
        if mesh is None:
            return jnp.full(shape, fill, dtype)
        spec = sharding.cache_spec(shape, batch is not None, head_axis if mode.splits_heads else None, mesh)
        return sharding.zeros(shape, dtype, spec, mesh, fill)

    try:
        layer = lambda sh=shapes: {n: zeros(lead + s, d, len(lead)) for n, (s, d) in sh.items()}  # noqa: E731
        loop = {n: zeros(lead + (passes, loop_blocks) + s, d, len(lead) + 2) for n, (s, d) in shapes.items()}
        return KVCache(pre=tuple(layer(ring_shapes if j in rings else shapes) for j in range(n_pre)), loop=loop,
                       pos=zeros(lead + (capacity,), jnp.int32, fill=-1), length=zeros(lead, jnp.int32), kv_mode=mode,
                       post=tuple(layer() for _ in range(n_post)),
                       ring_pos=zeros(lead + (ring_capacity,), jnp.int32, fill=-1) if rings else None, rings=rings)
    except Exception as e:  # noqa: BLE001 - XLA reports OOM as a generic runtime error
        if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
            raise RuntimeError(f"out of memory while allocating a KV cache: {e}") from e
        raise


# ---- reading and writing one layer ------------------------------------------------------------
# A layer's store is either a pre layer ({name: [lead, C, w]}, index None) or the loop stack
# ({name: [L, k, lead, C, w]}) at index (pass t, traced inside the pass loop; block j, static),
# or a stack of layers ({name: [n, lead, C, w]}) at index (layer,) (a layer loop's, traced).

def read(store: dict, index=None) -> dict:
    """The arrays of one layer: [lead, C, w] each."""
    if index is None:
        return store
    t, *j = index  # (pass, loop block) of a loop stack; (layer,) of a stack of layers
    return {n: jax.lax.dynamic_index_in_dim(a, t, axis=0, keepdims=False)[tuple(j)] for n, a in store.items()}


def by_slot(new: jax.Array, old: jax.Array, src: jax.Array, axis: int = -2) -> jax.Array:
    """old [.., C, ..] with each slot s taken from new's row src[s] along `axis` (src [C], -1:
    keep old's). The loop-free form of a chunk's scatter (XLA:CPU loops a scatter per index)."""
    ax = axis % old.ndim
    keep = (src >= 0).reshape((-1,) + (1,) * (old.ndim - 1 - ax))
    return jnp.where(keep, jnp.take(new, jnp.clip(src, 0, new.shape[ax] - 1), axis=ax), old)


def write(store: dict, fresh: dict, slots: jax.Array, src: jax.Array, index=None) -> dict:
    """Write a chunk's stored arrays ([lead, T, w]) into one layer: slots [T] says where each
    token goes (>= C: dropped), src [C] which token each slot takes (-1: none; `write_sources`).
    Decode (T = 1) is one in-place dynamic-update-slice per buffer; a longer chunk is `by_slot`
    (a scatter would be a loop of T updates per buffer on XLA:CPU: slower to compile and run)."""
    if slots.shape[0] == 1:
        if index is None:
            return {n: jax.lax.dynamic_update_slice_in_dim(a, fresh[n], slots[0], axis=1) for n, a in store.items()}
        return {n: jax.lax.dynamic_update_slice(a, fresh[n][(None,) * len(index)], (*index, 0, slots[0], 0))
                for n, a in store.items()}
    if index is None:
        return {n: by_slot(fresh[n], a, src) for n, a in store.items()}
    return {n: jax.lax.dynamic_update_slice(a, by_slot(fresh[n], read({n: a}, index)[n], src)[(None,) * len(index)],
                                            (*index, 0, 0, 0))
            for n, a in store.items()}


def write_positions(cache_pos: jax.Array, positions: jax.Array, slots: jax.Array, src: jax.Array) -> jax.Array:
    if slots.shape[0] == 1:
        return jax.lax.dynamic_update_slice_in_dim(cache_pos, positions, slots[0], axis=0)
    return by_slot(positions, cache_pos, src, axis=0)


def write_sources(start_pos: jax.Array, n_valid: jax.Array, capacity: int) -> jax.Array:
    """[capacity] int32: which token of a chunk at start_pos (its first n_valid real) each slot
    takes, -1 for none — the inverse of `write_slots`. The last `capacity` real tokens are kept;
    token i goes to slot (start_pos + i) % capacity, so slot s takes the one kept i congruent to
    s - start_pos."""
    lo = jnp.maximum(n_valid - capacity, 0)
    i = lo + jnp.mod(jnp.arange(capacity, dtype=jnp.int32) - start_pos - lo, capacity)
    return jnp.where(i < n_valid, i, -1).astype(jnp.int32)


def write_slots(positions: jax.Array, n_valid: jax.Array, capacity: int) -> jax.Array:
    """Slots for a chunk of positions [T]; tokens that must not be stored point past the end
    (dropped): padding (index >= n_valid) and all but the last `capacity` valid tokens."""
    idx = jnp.arange(positions.shape[0])
    keep = (idx < n_valid) & (idx >= n_valid - capacity)
    return jnp.where(keep, positions % capacity, capacity)


# ---- whole-segment operations ----------------------------------------------------------------

def first_passes(seg: KVCache, passes: int) -> KVCache:
    """The segment at a shallower depth: its first `passes` loop passes (a copy of them)."""
    return seg.replace(loop={n: a[:passes] for n, a in seg.loop.items()})


def append_passes(seg: KVCache, more: KVCache) -> KVCache:
    """seg's passes followed by `more`'s (same slots and positions): a deeper segment, whose coda
    layers are `more`'s (computed at the new depth)."""
    return seg.replace(loop={n: jnp.concatenate([seg.loop[n], more.loop[n]]) for n in seg.loop}, post=more.post)


def rollback(own: KVCache, length: jax.Array) -> KVCache:
    """Forget every position >= length (slots stay, masked by their position)."""
    forget = lambda p: None if p is None else jnp.where(p < length, p, -1)  # noqa: E731
    return own.replace(pos=forget(own.pos), ring_pos=forget(own.ring_pos), length=length.astype(jnp.int32))

