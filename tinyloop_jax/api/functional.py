"""The per-call pipeline as pure functions over (weights, segments, request), usable without a
`Model`: prefill a chunk, build / extend / re-depth a prefix, decode N requests (plain or
speculative). `Model` checks arguments, calls these, and turns the device results into lists.

    >>> w = model.weights
    >>> prefix = build_prefix(w, prompt, loops=4)                       # a PrefixCache
    >>> state = decode(w, prefix, [suffix], Knobs.make(1, max_tokens=16))
    >>> state.tokens[0, : state.n[0]]                                   # the emitted tokens

The seed-000 pair is a few lines on top of it:

    >>> saved = prefill_prefix_cache(prefix_ids, w)                     # a KVCache, length P
    >>> logits = next_token_logits_with_prefix(saved, len(prefix_ids), suffix_ids, w)

`saved` is never written: the suffix goes into a fresh segment of its own that attends to
`saved` read-only, so no clone is needed and the saved cache keeps its length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..model import adaptive as ad
from ..model import cache as kvc
from ..decoding import paged_decode, programs
from ..decoding import step as St
from ..model import paged, sharding
from ..model import page_pool
from ..model.cache import KVCache
from ..decoding.paged_decode import Decoded
from ..decoding.compiled import SHARED
from ..model.params import Weights
from .prefix import PrefixCache, prefix_at_depth  # noqa: F401 - prefix_at_depth is part of this API
from ..decoding.sampling import Knobs
from ..decoding.scoring import Scores
from ..decoding.speculative import Speculation
from ..model.exits import Exit


class Adaptive(NamedTuple):
    """A call's adaptive depth (`model.adaptive`): each row's exit rule, and whether the prompts
    may exit too (else they run every pass, so a prefix serves any rule)."""
    policy: ad.Policy  # [N]
    in_prefill: bool = False


def pad(tokens, size: int | None = None) -> np.ndarray:
    """Token ids -> int32 [bucket(n)] (or [size]), zero-padded: one compiled shape per bucket."""
    tokens = np.asarray(tokens, np.int32)
    out = np.zeros((size or kvc.bucket(len(tokens)),), np.int32)
    out[:len(tokens)] = tokens
    return out


def empty_cache(weights: Weights, n_tokens: int, loops: int | None = None, cache_window: int = 0, start: int = 0,
                kv_mode: str | None = None, batch: int | None = None) -> KVCache:
    """A fresh segment with room for `n_tokens` positions, starting at position `start`, stored
    in `kv_mode` (default the model's; another mode makes a working segment whose values are
    those of the model's mode, see `transformer.block`)."""
    c = weights.config
    loops = c.default_loops if loops is None else loops
    rings, ring = ring_plan(c, n_tokens, cache_window)
    own = kvc.empty(kv_mode or c.kv_mode, c.n_pre_blocks, loops, c.n_kv_heads,
                    kvc.segment_capacity(n_tokens, cache_window), c.head_dim, batch, c.loop_blocks, c.d_model,
                    c.n_post_blocks, c.mesh, rings, ring)
    return own.replace(length=jnp.full(own.length.shape, start, jnp.int32))


def ring_plan(c, n_tokens: int, cache_window: int = 0) -> tuple[tuple, int]:
    """The pre layers of `c` held as rings of their window (`cache.ring_plan` over its local
    layers, `page_pool.local_layers`), and the ring's slots."""
    local = page_pool.local_layers(c)
    return kvc.ring_plan([c.block_window(j) if j in local else 0 for j in range(c.n_pre_blocks)], n_tokens,
                         cache_window)


def prefill(weights: Weights, tokens, cache: KVCache, ro: tuple = (), start_pos: int | None = None,
            loops: int | None = None, cache_window: int = 0, exit: Exit | None = None,
            seed: int = 0) -> tuple[jax.Array, KVCache]:
    """Append `tokens` [T] to `cache` at positions start_pos + i (default cache.length),
    attending also to the read-only segments `ro`. Returns (next-token logits [V], new cache).
    `cache` is donated: do not use it afterwards. `seed`: injection models' initial states."""
    c = weights.config
    start = cache.length if start_pos is None else jnp.int32(start_pos)
    if c.block == "gpt2":  # learned positions: the host needs the start (one read of cache.length)
        c.check_positions(int(start) + len(tokens), "the chunk")
    out = programs.prefill(weights.params, c, jnp.asarray(pad(tokens)), jnp.int32(len(tokens)), start, tuple(ro),
                           cache, loops=c.default_loops if loops is None else loops, window=cache_window, exit=exit,
                           seed=jnp.uint32(seed))
    return out.logits, out.own


def decode_step(weights: Weights, token: int, cache: KVCache, ro: tuple = (), loops: int | None = None,
                cache_window: int = 0, exit: Exit | None = None, seed: int = 0) -> tuple[jax.Array, KVCache]:
    """One token at position cache.length (a chunk of one, `programs.prefill`). Returns
    (next-token logits [V], new cache); `cache` is donated."""
    c = weights.config
    c.require_full_share("decode_step on dense segments")
    if c.block == "gpt2":
        c.check_positions(int(cache.length) + 1, "the token")
    out = programs.prefill(weights.params, c, jnp.int32([token]), jnp.int32(1), cache.length, tuple(ro), cache,
                           loops=c.default_loops if loops is None else loops, window=cache_window, exit=exit,
                           seed=jnp.uint32(seed))
    return out.logits, out.own


# ---- prefixes --------------------------------------------------------------------------------

def _wrap(weights: Weights, own: KVCache, prompt: np.ndarray, loops: int, window: int, logits, seen, depth_states,
          state=None, seed: int = 0) -> PrefixCache:
    prompt = np.array(prompt, np.int32)
    prompt.setflags(write=False)
    return PrefixCache(cache=own, prompt=prompt, loops=loops, cache_window=window, logits=logits, seen=seen,
                       depth_states=depth_states, weights=weights, state=state, seed=seed)


def prefix_nbytes(weights: Weights, n_tokens: int, loops: int, cache_window: int = 0) -> int:
    c = weights.config
    rings, ring = ring_plan(c, n_tokens, cache_window)
    return kvc.cache_nbytes(c.kv_mode, c.n_cache_layers(loops), c.n_kv_heads,
                            kvc.segment_capacity(n_tokens, cache_window), c.head_dim, c.d_model, len(rings), ring)


def build_prefix(weights: Weights, prompt, loops: int | None = None, cache_window: int = 0,
                 keep_state: bool = False, exit: Exit | None = None, seed: int = 0) -> PrefixCache:
    """Prefill `prompt` [P] once into a PrefixCache (no decode). keep_state=True also keeps every
    position's stream after the last pass (D floats per token) for `prefix_at_depth` deeper.
    `exit`: which pass the stored next-token logits come from (gate models). `seed`: the
    initial loop states of injection models (`PrefixCache.seed`)."""
    loops = weights.config.default_loops if loops is None else loops
    prompt = np.asarray(prompt, np.int32)
    weights.config.check_positions(len(prompt), "the prompt")
    seen = jnp.asarray(programs.token_mask([prompt], weights.config.vocab_size)[0])
    pool, pages = prefix_pool(weights, len(prompt), loops, keep_state)
    own, logits, depths, stream = paged_prefix(weights, prompt, 0, pool, pages, loops, cache_window, exit, seed)
    state = None  # (keep_state: [bucket(P), D | 2D], its padding zeros)
    if keep_state:
        state = jnp.pad(stream, ((0, kvc.bucket(len(prompt)) - len(prompt)), (0, 0)))
    return _wrap(weights, own, prompt, loops, cache_window, logits, seen, depths, state, seed)


def prefix_pool(weights: Weights, n_tokens: int, loops: int,
                keep_state: bool = False) -> tuple[page_pool.PagedKV, np.ndarray]:
    """A prefix's pages while it is built (`paged_decode.prefix_pool`), checked beside the dense
    segment gathered from them and, with keep_state, every position's stream."""
    c = weights.config
    per_token = c.d_model * (1 + (c.injection != "none")) * jnp.dtype(c.compute_dtype).itemsize
    beside = prefix_nbytes(weights, n_tokens, loops) + (kvc.bucket(n_tokens) * per_token if keep_state else 0)
    return paged_decode.prefix_pool(c, n_tokens, loops, beside, f"a prefix of {n_tokens} tokens and its pages")


def paged_prefix(weights: Weights, prompt: np.ndarray, k: int, pool: page_pool.PagedKV, pages: np.ndarray,
                 loops: int, window: int, exit: Exit | None,
                 seed: int) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """prompt[k:] prefilled into `pool`, whose pages [R] hold the positions before k, and
    gathered into the prefix's dense segment with its window's ring and its local layers' rings
    (`paged_decode.fill_prefix`). Returns (segment, next-token logits [V], depth states
    [n_pre + loops, D], every fed position's stream after the last pass [P - k, D | 2D])."""
    c, n = weights.config, len(prompt)
    rings, ring = ring_plan(c, n, window)
    return paged_decode.fill_prefix(weights.params, c, pool, pages, k, np.asarray(prompt[k:]), loops, window, exit,
                                    seed, paged_decode.PREFILL_CHUNK, kvc.segment_capacity(n, window), rings, ring)


def extend_prefix(source: PrefixCache, k: int, prompt, exit: Exit | None = None) -> PrefixCache:
    """The prefix of `prompt` whose first k tokens are source's first k (0 < k < len(prompt)):
    those positions are loaded into the new prefix's pages (no compute), only prompt[k:] is
    prefilled."""
    w, loops, window = source.weights, source.loops, source.cache_window
    prompt = np.asarray(prompt, np.int32)
    w.config.check_positions(len(prompt), "the prompt")
    if not 0 < k < len(prompt) or not kvc.holds(source.cache, k, window, page_pool.local_window(w.config, window)):
        raise ValueError(f"k={k}: the source does not hold what its first {k} positions need "
                         f"(a prompt of {len(prompt)} tokens, the source's ring or window is shorter)")
    pool, pages = prefix_pool(w, len(prompt), loops)
    pool = SHARED.load_segment(pool, source.cache, jnp.asarray(pages), jnp.int32(0), jnp.int32(k))
    own, logits, depths, _ = paged_prefix(w, prompt, k, pool, pages, loops, window, exit, source.seed)
    seen = jnp.asarray(programs.token_mask([prompt], w.config.vocab_size)[0])
    return _wrap(w, own, prompt, loops, window, logits, seen, depths, seed=source.seed)


# ---- scoring ---------------------------------------------------------------------------------

def score(weights: Weights, seqs: np.ndarray, n_valid: np.ndarray, loops: int, top: int = 0, cache_window: int = 0,
          exit: Exit | None = None, seed: int = 0) -> Scores:
    """B sequences seqs [B, T] (row b real up to n_valid [B]) scored by the step over pages of
    their own, `PREFILL_CHUNK` positions a step (`step.step(targets=...)`): `Scores` [B, T, ...]
    on the device, row i about token i given the tokens before it (row 0 zeros), at depth
    `loops`; every position attends within cache_window (0: all). `seed`: injection models'
    initial states. Rows past n_valid hold what their padding scored."""
    c = weights.config
    seqs, n_valid = np.asarray(seqs, np.int32), np.asarray(n_valid, np.int32)
    extra = sharding.rows(c.mesh, len(seqs)) - len(seqs)  # (split over 'data': filler rows)
    seqs, n_valid = np.pad(seqs, ((0, extra), (0, 0))), np.pad(n_valid, (0, extra))
    (N, T), chunk = seqs.shape, min(paged_decode.PREFILL_CHUNK, kvc.bucket(seqs.shape[1]))
    lay = paged_decode.layout(0, T, N, window=page_pool.local_window(c), step=chunk)
    kvc.check_fits(paged_decode.pool_nbytes(c, loops, lay), f"scoring {N} sequence(s) of {T} tokens at loops={loops}")
    compact = not c.share.full  # (the prompts on pass slots)
    pool = paged_decode.empty_pool(c, loops, lay.n_pages, lay, compact=compact)
    pool = page_pool.swap(pool) if compact else pool
    state = St.requests_of(np.zeros((N, c.vocab_size), bool), Knobs.make(N, seeds=[seed] * N, max_tokens=1),
                           d_model=c.d_model, dtype=c.compute_dtype)
    # position j is scored at token j + 1; both padded so that any chunk's slice is whole
    ids, nxt = np.pad(seqs, ((0, 0), (0, chunk))), np.pad(seqs[:, 1:], ((0, 0), (0, chunk + 1)))
    parts = []
    for at in range(0, T, chunk):
        n_new = np.clip(n_valid - at, 0, chunk).astype(np.int32)
        width, k = kvc.bucket(max(int(n_new.max()), 1)), min(chunk, T - at)
        chunks = St.Chunks(paged.Rows(lay.tables, np.full((N,), at, np.int32), n_new), ids[:, at:at + width], None,
                           n_new > 0)
        got, _, pool, state = SHARED.step(weights.params, c, pool, state, chunks, None, loops=loops, exit=exit,
                                          window=cache_window, targets=jnp.asarray(nxt[:, at:at + width]), top=top)
        # the chunk's k positions (a chunk whose rows all end early: zeros past them)
        parts.append(jax.tree.map(lambda a: jnp.pad(a[:, :k], [(0, 0), (0, k - min(k, a.shape[1]))]
                                                    + [(0, 0)] * (a.ndim - 2)), got.scores))
    # row i about token i: position i - 1's score, and zeros for the first
    return Scores(*(jnp.concatenate([jnp.zeros_like(a[:len(a) - extra, :1]), a[:len(a) - extra, :-1]], axis=1)
                    for a in (jnp.concatenate(p, axis=1) for p in zip(*parts))))


# ---- decoding --------------------------------------------------------------------------------

def own_room(longest_suffix: int, max_new: int, cache_window: int, speculation: Speculation | None):
    """(positions, window) an own segment is sized for: the suffix and the new tokens, plus
    lookahead + 1 for a speculative verify chunk written before its rollback."""
    room, ring = longest_suffix + max_new, cache_window
    if speculation is not None:
        room += speculation.lookahead + 1
        ring = cache_window + speculation.lookahead + 1 if cache_window else 0
    return room, ring


def decode(weights: Weights, prefix: PrefixCache | None, suffixes: list, request: Knobs, loops: int | None = None,
           cache_window: int | None = None, speculation: Speculation | None = None,
           exit: Exit | None = None, adaptive: Adaptive | None = None, grammars: list | None = None) -> Decoded:
    """N requests, each = prefix (shared, read once per step for all; or none) + its suffix
    (possibly empty when there is a prefix) + up to request.max_tokens new tokens: the call's
    pages (`decoding.paged_decode`), the suffixes prefilled as one group of chunks, then the
    on-device decode loop over the paged step. grammars [N]: each row's `Grammar` (structured
    output) or None; with any, the decode loop is driven from the host, a mask a token
    (`paged_decode.decode_constrained`; adaptive depth and speculative rounds: the device loop
    asks for them by callback).

    loops / cache_window default to the prefix's. Returns the `paged_decode.Decoded` (on device):
    row i emitted tokens[i, :n[i]] (on a mesh, rows past len(suffixes) are filler)."""
    c = weights.config
    extra = sharding.rows(c.mesh, len(suffixes)) - len(suffixes)
    if extra:  # the batch is split over 'data': filler rows that stop after one token
        suffixes, request = list(suffixes) + [suffixes[-1]] * extra, request.pad(extra)
        if adaptive is not None:
            adaptive = adaptive._replace(policy=jax.tree.map(
                lambda a: jnp.concatenate([a, jnp.repeat(a[-1:], extra, axis=0)]), adaptive.policy))
    loops = (prefix.loops if prefix is not None else c.default_loops) if loops is None else loops
    window = (prefix.cache_window if prefix is not None else 0) if cache_window is None else cache_window
    if not c.share.full:  # (the prompts per pass, then the pool collapsed for the decode steps)
        c.share.check(loops)
        if speculation is not None:
            raise ValueError(f"kv_share={c.kv_share!r}: speculative decoding with it is not served yet")
    N, P = len(suffixes), 0 if prefix is None else len(prefix)
    lens = np.array([len(s) for s in suffixes], np.int32)
    max_new = int(np.max(request.max_tokens))
    c.check_positions(P + int(lens.max()) + max_new - 1, "decoding")  # the last emitted token is never fed
    prior_logits = prefix.logits if prefix is not None else jnp.zeros((c.vocab_size,), jnp.float32)
    if prefix is not None and c.early_exit_gate:  # the prefix's logits with this call's exit
        prior_logits = programs.prefix_logits(weights.params, c, prefix.depth_states, loops=loops, exit=exit)
    prior_seen = prefix.seen if prefix is not None else jnp.zeros((c.vocab_size,), bool)
    if adaptive is None:
        lay = call_layout(c, P, int(lens.max()), max_new, N, speculation)
        pol = warm = windows = None
    else:
        lay = paged_decode.layout(P, int(lens.max()) + max_new, N)
        pol, windows = adaptive.policy, np.full((N,), window, np.int32) if window else None
        warm = (prefix.depth_states[c.n_pre_blocks + loops - 1] if prefix is not None
                else jnp.zeros((c.d_model,), c.compute_dtype))  # the loop state a prompt starts from
    compact = not c.share.full  # the prompts on pass slots, collapsed after them
    pool = paged_decode.empty_pool(c, loops, lay.n_pages, lay, compact=compact)
    if prefix is not None:  # (a compact pool: into its pass slots)
        pool = paged_decode.load_prefix(weights.params, c, pool, prefix.cache, P, lay)
    seen = jnp.asarray(programs.token_mask(suffixes, c.vocab_size)) | prior_seen
    state = St.requests_of(seen, request, d_model=c.d_model, dtype=c.compute_dtype, pol=pol, warm=warm)
    chunk = paged_decode.PREFILL_CHUNK if lay.slot_of is not None else 0  # (a ring: chunks it holds)
    matchers = masks = None
    if grammars is not None and any(g is not None for g in grammars):
        from ..decoding.grammar import fill_masks

        if speculation is not None and c.mesh is not None:
            raise ValueError("response_format does not go with draft_loops (speculative decoding) on a mesh yet")
        matchers = [None if g is None else g.matcher() for g in grammars] + [None] * extra
        masks = fill_masks(matchers, c.vocab_size)
    fill = paged_decode.prefill(weights.params, c, page_pool.swap(pool) if compact else pool, state, lay.tables, P,
                                suffixes, prior_logits, loops,
                                0 if windows is not None else window, exit, chunk, adaptive=adaptive is not None,
                                exits=adaptive is not None and adaptive.in_prefill, windows=windows, masks=masks)
    if compact:
        fill = fill._replace(pool=paged_decode.collapse(page_pool.swap(fill.pool), loops))
    rows = paged.Rows(lay.tables, P + lens, np.ones((N,), np.int32), windows)  # where each first token is fed
    if matchers is not None and ((paged_decode.GRAMMAR_LOOP == "host" and adaptive is None and speculation is None)
                                 or c.mesh is not None):  # (no host callback inside a program split over devices)
        return paged_decode.decode_constrained(weights.params, c, rows, fill, request,
                                               loops, 0 if windows is not None else window, kvc.bucket(max_new),
                                               matchers, exit)
    # the output buffer in the own segment's buckets (16 and up): calls that differ only in a
    # max_tokens of 16 or less share one program (it was 8 and 16, one compile each)
    spec = dict(draft_loops=speculation.draft_loops, lookahead=speculation.lookahead) if speculation else {}
    return paged_decode.decode(weights.params, c, rows, fill, request, loops, 0 if windows is not None else window,
                               kvc.bucket(max_new), exit, matchers=matchers, **spec)


def call_layout(c, prefix_len: int, longest: int, max_new: int, n_rows: int,
                speculation: Speculation | None = None) -> paged_decode.Layout:
    """A `decode` call's pages (`paged_decode.layout`): with local layers (windows of their own),
    their slots in rings as long as the window and one step: a prompt chunk (`PREFILL_CHUNK`) or
    a verify chunk."""
    room = own_room(longest, max_new, 0, speculation)[0]
    window = page_pool.local_window(c)
    step = max(min(longest, paged_decode.PREFILL_CHUNK), speculation.lookahead + 1 if speculation is not None else 1)
    return paged_decode.layout(prefix_len, room, n_rows, window=window, step=step)


def generate(weights: Weights, prompts: list, request: Knobs, loops: int | None = None, cache_window: int = 0,
             speculation: Speculation | None = None, exit: Exit | None = None,
             adaptive: Adaptive | None = None, grammars: list | None = None) -> Decoded:
    """N unrelated prompts, decoded together (`decode` without a prefix); with adaptive depth
    one prompt is built as a prefix first (unless it may exit early)."""
    loops = weights.config.default_loops if loops is None else loops
    check_fits(weights, [len(p) for p in prompts], request, loops, cache_window, speculation)
    if len(prompts) == 1 and adaptive is not None and not adaptive.in_prefill:
        prefix = build_prefix(weights, prompts[0], loops, cache_window, exit=exit, seed=int(request.seed[0]))
        return decode(weights, prefix, [np.zeros((0,), np.int32)], request, loops, cache_window, speculation, exit,
                      adaptive, grammars)
    return decode(weights, None, prompts, request, loops, cache_window, speculation, exit, adaptive, grammars)


def check_fits(weights: Weights, prompt_lens: list, request: Knobs, loops: int, cache_window: int,
               speculation: Speculation | None = None, prefix_len: int = 0) -> None:
    """RuntimeError, before anything is allocated or compiled, if the caches of this call
    cannot fit in the memory free now: N requests of prompt_lens tokens after a prefix of
    prefix_len, in the call's pages (`paged_decode.layout`)."""
    c = weights.config
    lay = call_layout(c, prefix_len, max(prompt_lens), int(np.max(request.max_tokens)), len(prompt_lens), speculation)
    need = paged_decode.pool_nbytes(c, loops, lay)
    kvc.check_fits(need, f"the KV caches of {len(prompt_lens)} request(s) at loops={loops} "
                         f"({c.n_cache_layers(loops)} layers, {c.kv_mode})")


# ---- the seed-000 pair -----------------------------------------------------------------------

def prefill_prefix_cache(prefix_ids, weights: Weights) -> KVCache:
    """Prefill `prefix_ids` into a fresh cache (default depth, full window) and return the
    cache (in memory; nothing is written to disk)."""
    prefix_ids = np.asarray(prefix_ids, np.int32)
    _, cache = prefill(weights, prefix_ids, empty_cache(weights, len(prefix_ids)))
    return cache


def next_token_logits_with_prefix(saved: KVCache, prefix_len: int, suffix_ids, weights: Weights) -> np.ndarray:
    """The last suffix token's next-token logits [V], reusing `saved`; the suffix's i-th token
    gets absolute position prefix_len + i."""
    suffix_ids = np.asarray(suffix_ids, np.int32)
    own = empty_cache(weights, len(suffix_ids), loops=saved.passes, start=prefix_len)
    logits, _ = prefill(weights, suffix_ids, own, ro=(saved,), start_pos=prefix_len, loops=saved.passes)
    return np.asarray(logits, np.float32)


# Seed 000's names for the pair above.
save_prefix_cache = prefill_prefix_cache
generate_with_prefix = next_token_logits_with_prefix
