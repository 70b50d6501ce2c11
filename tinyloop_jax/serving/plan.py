"""The step plan: the shapes a depth's step programs take (decode rows, chunk length, page-table
length), from which warmup compiles every program ahead of time (`Plan`, over the engine's
`Budget`; the `Batcher` holds one and picks its steps' shapes from it).
"""

from __future__ import annotations

import jax
import numpy as np

from . import step as S
from .. import settings
from ..decoding.grammar import words
from ..decoding.sampling import Knobs, SamplingParams
from ..model import adaptive as ad
from ..model import page_pool, paged
from ..model.cache import EXIT_BLOCK


MAPPINGS_A_PROGRAM = 2_500  # warmup stops short of vm.max_map_count by two of the largest programs
MIN_TABLE = page_pool.MIN_TABLE


def pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def batch_buckets(max_batch: int) -> list[int]:
    """Row counts programs are compiled for: powers of two below max_batch, and max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch} | {max_batch})


def chunk_buckets(max_batch: int) -> list[int]:
    """Decode row counts of a step beside a prompt chunk: 2, then 16, 128, ... below max_batch,
    and max_batch. The chunk's T >= 32 tokens set such a step's cost, so padding the rows beside
    it costs little (SmolLM2 as served, T = 32: 1 row 48.0 ms, 2 47.7, 4 53.0, 8 58.2, 16 68.5;
    T = 64: 81.9 / 84.0 / 84.8 / 89.1 / 99.0), while each bucket is a program for every chunk
    length (~30 MiB kept and ~3 s of warmup each on SmolLM2: docs/benchmarks.md)."""
    return sorted({min(2, max_batch), max_batch} | {2 << 3 * i for i in range(1, 8) if 2 << 3 * i < max_batch})


class Plan:
    """The shapes of a depth's programs and their warmup, for `model` within `budget`."""

    def __init__(self, model, budget):
        self.model, self.budget = model, budget
        self.cfg, self.page_size, self.max_batch = budget.cfg, budget.page_size, budget.max_batch

    def table_len(self, positions: int) -> int:
        """Page-table entries of a step whose longest row holds `positions`: the whole context's
        when attention reads only live pages (a kernel: one program for every length),
        else a power of two (the XLA reference reads every entry)."""
        whole = -(-self.cfg.max_seq_len // self.page_size)
        if paged.attention_kernel(self.cfg) != "xla":
            return whole
        return min(pow2(-(-positions // self.page_size), MIN_TABLE), pow2(whole, MIN_TABLE))

    def step_shapes(self, loops: int) -> list[tuple[int, int, int]]:
        """Every (decode rows, chunk length, page-table length) a depth's steps can have."""
        whole = -(-self.cfg.max_seq_len // self.page_size)
        tables = sorted({self.table_len(n * self.page_size) for n in range(1, whole + 1)})
        return ([(bd, 0, R) for R in tables for bd in batch_buckets(self.max_batch)]
                + [(bd, T, R) for R in tables for bd in chunk_buckets(self.max_batch) for T in self.chunk_sizes()])

    def chunk_sizes(self) -> list[int]:
        """A prompt chunk's padded lengths: 32 and the whole chunk (a question after a cached
        system prompt pays for 32 tokens, a longer rest for the chunk: each length is a program
        for every decode bucket, so few lengths keep warmup short)."""
        chunk = self.budget.chunk
        return sorted({min(32, chunk), chunk})

    def exit_lengths(self) -> list[int]:
        """A prompt exiting in prefill's padded lengths: 512 positions, four times as many, ...,
        and the whole context. Its passes run `cache.EXIT_BLOCK` positions at a time, over as
        many blocks as it fills, so each length is one program for every prompt up to it; the
        lengths are few only so that a short prompt's buffers are short (on SmolLM2 a 40-token
        prompt takes 97 ms in a buffer of 8,192 positions, 76 in one of 512)."""
        whole, lengths, n = EXIT_BLOCK * -(-self.cfg.max_seq_len // EXIT_BLOCK), [], 512
        while n < whole:
            lengths.append(n)
            n *= 4
        return lengths + [whole]

    def warmup(self, loops: int, jits, known: set, store=None, fresh: bool = True, adaptive: bool = False,
               speculation=(), grammar: bool = False) -> set:
        """Compile every program of a depth's steps by its `jits` (ahead of time: nothing is
        allocated or run, so any thread may call it while the loop serves); returns the keys of
        those not in `known` (compiled now). fresh: also the program of the depth's pool (made on its
        first request); store: the loads of its entries at this depth. adaptive:
        also the adaptive-depth programs (a prompt's chunk alone, the decode rows' adaptive
        steps, a prompt exiting in prefill at each of `exit_lengths`); speculation: also the
        speculative rounds of these (draft_loops, lookahead) pairs; grammar: also the programs
        a decode-only step with a structured-output row runs (its forward and choice apart;
        adaptive: one masked step). A prompt chunk beside decode rows always takes masks."""
        w, c, P, b = self.model.weights, self.cfg, self.page_size, self.budget
        n_pages = b.pool_pages(loops)
        pool = jax.eval_shape(lambda: b.empty_pool(loops, n_pages))
        compact = not c.share.full  # prompts on the pass slots (a chunk alone: `page_pool.swap`), then collapsed
        prompts = page_pool.swap(pool) if compact else pool
        state = jax.eval_shape(b.empty_rows)
        exit = self.model.exit_for(loops)
        new = set()

        def compile_(key, program, *args, **kw):
            if key not in known and key not in new:
                room = settings.mapping_headroom()
                if room is not None and room < MAPPINGS_A_PROGRAM:  # a refusal, not the compiler's crash
                    raise RuntimeError(
                        f"warmup stopped before program {key}: this process may make {room} more memory mappings "
                        f"under vm.max_map_count, and a compiled program takes up to ~{MAPPINGS_A_PROGRAM // 2} "
                        f"(XLA:CPU's compiler fails past the limit): warm fewer kinds (adaptive, speculation, "
                        f"grammar) or depths, or raise vm.max_map_count (sysctl)")
                program.lower(*args, **kw).compile()
                new.add(key)

        tables = sorted({R for _, _, R in self.step_shapes(loops)})
        W = words(c.vocab_size)
        masks = (None, "masked") if grammar else (None,)
        mask = lambda rows, m: None if m is None else np.zeros((rows, W), np.int32)  # noqa: E731
        alone = [(0, T, R) for R in tables for T in self.chunk_sizes()] if adaptive else []  # a chunk alone
        for bd, T, R in self.step_shapes(loops) + alone:
            if bd and not T:  # decode rows alone: `decode_steps` (plain; adaptive: each row's passes stop at its exit)
                for kind in (False, True) if adaptive else (False,):
                    for m in masks:  # (a masked step: one a dispatch)
                        if m and not kind:  # plain: the forward, then the choice (`Batcher._choose`)
                            decodes = S.make_decodes([], [], [], [], R, bd, left=[])
                            compile_(("forward", loops, bd, R), jits["decode_forward"], w.params, c, pool, state,
                                     decodes, loops=loops, exit=exit)
                            choice = S.make_decodes([], [], [], [], 1, bd, left=[], mask=mask(bd, m))
                            compile_(("choose", loops, bd, m), jits["decode_choose"], state, choice,
                                     jax.ShapeDtypeStruct((bd, c.vocab_size), np.float32))  # (float32 logits)
                            continue
                        decodes = S.make_decodes([], [], [], [], R, bd, left=[], mask=mask(bd, m))
                        compile_(("steps", loops, bd, R, kind) + ((m,) if m else ()), jits["decode_steps"], w.params,
                                 c, pool, state, decodes, np.int32(1), loops=loops,
                                 n_max=1 if m else b.decode_steps, exit=exit, adaptive=kind)
                for d, k in speculation:  # a speculative round (one program per lookahead: the draft depth is traced)
                    for m in masks:  # (with a grammar: the drafts' masks asked of the host, `Batcher._speculate`)
                        decodes = S.make_decodes([], [], [], [], R, bd, left=[], mask=mask(bd, m))
                        compile_(("speculate", loops, k, bd, R) + ((m,) if m else ()), jits["decode_steps"], w.params,
                                 c, pool, state, decodes, np.int32(1), loops=loops, n_max=k + 1, exit=exit,
                                 draft_loops=np.int32(d), lookahead=k, grammar=np.int32(0) if m else None)
                continue
            if not T:
                continue
            for m in masks if not bd else ("masked",):  # (a chunk beside decode rows: always masks)
                chunks = S.make_chunks([], [], [], [], [], T, R, 1, mask=mask(1, m))
                decodes = S.make_decodes([], [], [], [], R, bd, left=[], mask=mask(bd, m)) if bd else None
                compile_(("step", loops, bd, T, R) + ((m,) if m and not bd else ()), jits["step"], w.params, c,
                         pool if bd else prompts, state, chunks, decodes, loops=loops, exit=exit)
        for R in tables if adaptive else ():
            for T in self.exit_lengths():
                for m in masks:
                    chunks = S.make_chunks([], [], [], [], [], T, R, 1, mask=mask(1, m))
                    compile_(("in_prefill", loops, T, R) + ((m,) if m else ()), jits["step"], w.params, c,
                             prompts, state, chunks, None, loops=loops, in_prefill=True)
        req = Knobs.from_params([SamplingParams()], logit_bias=True, sampled=True, stop_shape=S.STOPS)
        compile_(("admit", loops), jits["admit"], state, np.int32(0), np.zeros((c.vocab_size,), bool), req,
                 jax.tree.map(np.asarray, ad.EVERY_PASS))
        one = np.zeros((1,), np.int32)
        compile_(("copy", loops), jits["copy_pages"], pool, one, one)
        whole = -(-c.max_seq_len // P)
        for n in sorted({pow2(k, MIN_TABLE) for k in range(1, whole + 1)}) if compact else ():  # a prompt's end
            compile_(("collapse", loops, n), jits["collapse_pages"], pool, np.zeros((n,), np.int32), loops=loops)
        if fresh:  # the depth's pool and rows, made on its first request
            compile_(("pool", loops, n_pages), jits["empty_pool"], c, loops, n_pages, P, None,
                     b.local_slots(n_pages) if b.local else None, b.prompt_slots(n_pages))
        if store is not None and store.loops == loops:  # loads of the store's entries
            for e in (e for e in store.entries() if b.local or not e.cache.rings):
                R = pow2(-(-len(e.prompt) // P), MIN_TABLE)
                compile_(("load", loops, e.cache.capacity, R), jits["load_segment"], pool, e.cache,
                         np.zeros((R,), np.int32), np.int32(0), np.int32(0))
        return new
