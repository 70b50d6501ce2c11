"""K/V shared across a looped model's passes (`kv_share`): which of a finished token's passes
later tokens read, and the compact store that holds only those.

A looped model keeps K/V for every (pass, loop block): `loops` times an ordinary model's. Once
a token is finished — its prompt processed, or its decode step done — the modes read it so:

    full     pass p reads the token's pass p (every pass kept; the default)
    ring:m   pass p reads the token's latest pass q = p (mod m); m slots a loop block, m divides
             the loops. `last` is ring:1 (every pass reads its last pass). Huginn's
             `compress-s{m*k}` (k its core's blocks): each pass writes slot p mod m, later passes
             overwrite earlier ones
    avg      the mean of the token's passes (Ouro's "averaged"): 1 slot
    first    its first pass (experimental: only for models trained for it): 1 slot

A token's own passes read its own fresh K/V (attention within a pass), whatever the mode: the
modes differ only in what later tokens read. A prompt keeps every pass until its last token is
processed (its chunks read each other per pass, so one chunk == token by token); then it is
collapsed (`collapse`) and every decoded token is stored collapsed, `slots(loops)` layers a
loop block instead of `loops`. Pre and coda blocks are not looped: they keep their one layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .kv_modes import KVMode

MODES = ("full", "last", "ring:m", "avg", "first")


@dataclass(frozen=True)
class Share:
    """A parsed `kv_share` (hashable: static in programs)."""

    kind: str  # "full" | "ring" | "avg" | "first"
    m: int = 0  # ring:m's m

    def __str__(self) -> str:
        return f"ring:{self.m}" if self.kind == "ring" else self.kind

    @property
    def full(self) -> bool:
        return self.kind == "full"

    def check(self, loops: int) -> None:
        """ValueError naming the mode if it cannot serve `loops` passes."""
        if self.kind == "ring" and loops % self.m:
            raise ValueError(f"kv_share={str(self)!r} needs loops divisible by {self.m}, got loops={loops}")

    def slots(self, loops: int) -> int:
        """Layers a loop block keeps of a finished token."""
        return loops if self.full else self.m if self.kind == "ring" else 1

    def slot(self, p):
        """The slot pass p (an int or traced) writes and reads in a compact store."""
        return p if self.full else p % self.m if self.kind == "ring" else 0 * p

    def source(self, p: int, ran: int) -> int | None:
        """The pass whose K/V pass p reads of a finished token that ran passes 0..ran-1 (None:
        avg, the mean of them all). ring:m with no pass = p (mod m) run (a token that stopped
        early): its latest pass."""
        if self.full:
            return p
        if self.kind == "first":
            return 0
        if self.kind == "avg":
            return None
        same = [q for q in range(ran) if q % self.m == p % self.m]
        return same[-1] if same else ran - 1


@functools.lru_cache(maxsize=None)
def parse(name: str | Share) -> Share:
    """'ring:4' -> Share('ring', 4); unknown names: ValueError listing the modes."""
    if isinstance(name, Share):
        return name
    if name in ("full", "avg", "first"):
        return Share(name)
    if name == "last":
        return Share("ring", 1)
    if isinstance(name, str) and name.startswith("ring:") and name[5:].isdigit() and int(name[5:]) >= 1:
        return Share("ring", int(name[5:]))
    raise ValueError(f"kv_share={name!r}; expected one of {', '.join(MODES)} (m >= 1)")


def collapse(stack: dict, share: Share, loops: int, mode: KVMode) -> dict:
    """The loop stack of a finished run {name: [passes >= loops, k, ...]} (stored in `mode`) ->
    its compact store {name: [slots, k, ...]}: slot s holds what a later pass p with slot(p) = s
    reads (ring: the latest pass = s (mod m); avg: the mean of passes < loops, re-encoded in
    `mode`; first: pass 0)."""
    share.check(loops)
    if share.full:
        return {n: a[:loops] for n, a in stack.items()}
    if share.kind == "ring":
        take = np.array([share.source(s, loops) for s in range(share.m)])
        return {n: a[take] for n, a in stack.items()}
    if share.kind == "first":
        return {n: a[:1] for n, a in stack.items()}
    if mode.h:
        raise ValueError(f"kv_share='avg' averages K/V; kv_mode {mode} stores h (use a K/V mode)")
    k, v = mode.unpack({n: a[:loops] for n, a in stack.items()}, None)
    return {n: a.astype(stack[n].dtype) for n, a in mode.pack(None, k.mean(0, keepdims=True),
                                                              v.mean(0, keepdims=True)).items()}


def expand(compact: dict, share: Share, loops: int) -> dict:
    """A compact store back as `loops` passes, pass p holding what it reads (slot(p)): the
    naive store's view (tests)."""
    take = np.array([int(share.slot(p)) for p in range(loops)])
    return {n: a[take] for n, a in compact.items()}


def layers_per_token(cfg, loops: int, share: Share | str) -> int:
    """Cache layers a finished token holds: pre blocks, the loop blocks' slots, coda blocks."""
    return cfg.n_pre_blocks + parse(share).slots(loops) * cfg.loop_blocks + cfg.n_post_blocks


def bytes_per_token(cfg, loops: int, share: Share | str, kv_mode: str | KVMode | None = None) -> int:
    """Bytes a finished token's K/V hold in `kv_mode` (default the model's)."""
    from .kv_modes import kv_mode as parse_mode

    mode = cfg.storage if kv_mode is None else parse_mode(kv_mode)
    return layers_per_token(cfg, loops, share) * mode.layer_nbytes(cfg.n_kv_heads, 1, cfg.head_dim, cfg.d_model)


def take_at(stack: dict, j: int, page: jax.Array, off: jax.Array, slot=0) -> dict:
    """A slot (traced or not), loop block j of a compact pool's loop stack at the step's targets
    (page, off [N]) -> {name: [lead, N, w]} (targets past the pool read its last page: never
    written back)."""
    return {n: jax.lax.dynamic_index_in_dim(a, slot, 0, keepdims=False)[j][:, jnp.minimum(page, a.shape[3] - 1), off]
            for n, a in stack.items()}


def put_at(stack: dict, j: int, page: jax.Array, off: jax.Array, values: dict, slot: int = 0) -> dict:
    """`take_at`'s inverse: values written at `slot`, loop block j (targets past the pool dropped)."""
    return {n: a.at[slot, j, :, page, off].set(values[n].astype(a.dtype).transpose(1, 0, 2), mode="drop")
            for n, a in stack.items()}


def filled(share: Share, slot: int, depth: jax.Array, loops: int) -> jax.Array:
    """bool [N]: slot `slot` of a token that ran `depth` [N] of `loops` passes takes its last
    pass's K/V — some skipped pass p (depth <= p < loops) writes that slot (an adaptive exit's
    skipped passes are filled with its last pass, then collapsed)."""
    if share.kind != "ring":
        return depth < loops
    first_skipped = depth + (slot - depth) % share.m  # the first p >= depth with p = slot (mod m)
    return first_skipped < loops
