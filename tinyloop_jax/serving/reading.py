"""Reading a dispatched step's tokens back: each emitted to its `Handle` with the stop sequence
the step found it to end (-1: none), rows finishing at a stop or at max_tokens; and the
speculative rounds, dispatched and read at once. A base of `Batcher`.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from . import step as S
from .depth import Depth, Row
from .plan import batch_buckets
from ..decoding import grammar as G
from ..decoding.grammar import take


class Reading:
    """`Batcher`'s reading of the step's output (its base)."""

    def _speculate(self, d: Depth) -> None:
        """One speculative round for every speculating row whose last token is read (rows with the
        same draft depth and lookahead in one program), read at once: how many tokens a round
        emits decides where the next one starts."""
        groups = collections.defaultdict(list)
        for r in d.rows.values():
            if r.decoding and r.handle.speculation is not None and r.ahead == 0 and not r.left:
                groups[r.handle.speculation].append(r)
        counts = self.depth_counts[d.loops]
        for spec, rows in groups.items():
            k = spec.lookahead
            starts = [r.fed + len(r.handle.tokens) - 1 for r in rows]  # where the last token is fed
            R = self.plan.table_len(max(starts) + k + 1)
            bd = next(b for b in batch_buckets(self.max_batch) if b >= len(rows))
            left = [r.handle.params.max_tokens - len(r.handle.tokens) for r in rows]
            # structured output: the first position's masks from the matchers (which took every token
            # read), the drafts' asked of them in the round (`grammar.draft_masks`), rolled back after
            matchers = [r.handle.matcher for r in rows] + [None] * (bd - len(rows))
            call = G.register(matchers, reads=True) if any(m is not None for m in matchers) else None
            decodes = S.make_decodes([r.pages for r in rows], starts, [r.slot for r in rows],
                                     [len(r.handle.tokens) for r in rows], R, bd, [r.handle.cache_window for r in rows],
                                     left, None if call is None else G.fill_masks(matchers, self.cfg.vocab_size))
            for r, q in zip(rows, starts):
                d.window(r, q, k + 1)
            d.sync()
            w = self.model.weights
            try:
                got, d.pool, d.state = self._run(
                    ("speculate", d.loops, k, bd, R) + ("masked",) * (call is not None),
                    self.jits(d.loops)["decode_steps"], w.params, w.config, d.pool, d.state, decodes, np.int32(1),
                    loops=d.loops, n_max=k + 1, exit=d.exit, draft_loops=np.int32(spec.draft_loops), lookahead=k,
                    grammar=None if call is None else np.int32(call))
                got = jax.tree.map(np.asarray, got)
            finally:
                if call is not None:
                    G.release(call)
            self.stats["speculative_rounds"] += 1
            self.stats["batch_rows"] += len(rows)
            counts["tokens_computed"] += len(rows) * (k + 1)
            counts["passes"] += len(rows) * (k * spec.draft_loops + (k + 1) * d.loops)
            for i, r in enumerate(rows):  # d_1 .. d_a and the next token, cut at a stop, at max_tokens and
                # where the grammar ends
                r.handle.drafted += k
                r.handle.accepted += int(got.accepted[i])
                for t, stop in zip(got.out.tokens[i, :got.n[i]], got.out.stops[i]):
                    if not r.left:
                        self._emit(d, r, int(t), int(stop))

    def _read(self, d: Depth, ran: list) -> None:
        """The tokens of a dispatched step (waits for it), emitted for the rows still in; with
        adaptive depth the passes each decode row ran are counted and kept."""
        host = {}

        def get(a):  # an `Emitted` on the host
            if id(a) not in host:
                host[id(a)] = jax.tree.map(np.asarray, a)
            return host[id(a)]

        counts = self.depth_counts[d.loops]
        for r, i, tok, passes, *many in ran:
            if not many:  # a prompt's first token
                r.ahead -= 1
                if not r.left:
                    got = get(tok)
                    self._emit(d, r, int(got.tokens[i]), int(got.stops[i]))
                continue
            # (`decode_steps`) its k tokens, up to a stop; its readers woken once; with adaptive
            # depth the passes each ran
            r.ahead -= many[0]
            got, ps = get(tok), None if passes is None else get(passes)
            tokens, stops = (a.reshape(len(a), -1) for a in (got.tokens, got.stops))  # (`step`: [b])
            for j in range(many[0]):
                t = int(tokens[i, j])
                if t < 0:
                    break
                if ps is not None:
                    p = int(ps[i, j])
                    counts["passes"] += p
                    counts["passes_skipped"] += d.loops - p
                    if not r.left and r.handle.policy is not None:
                        r.handle.passes.append(p)
                if not r.left:
                    self._emit(d, r, t, int(stops[i, j]), wake=False)
            r.handle.wake()

    def _emit(self, d: Depth, r: Row, t: int, stop: int, wake: bool = True) -> None:
        """Token t of row r, which the step found to end its stop sequence `stop` (-1: none)."""
        h, s = r.handle, r.handle.params
        h.emit(t, wake)
        self.stats["tokens_out"] += 1
        if len(h.tokens) == 1:
            self._on_first_token(h)
        done, error = (False, None) if h.matcher is None else take(h.matcher, t)
        if error is not None:
            self.release(d, r, "error", RuntimeError(error))
        elif done:  # the grammar is complete
            self.release(d, r, "stop")
        elif stop >= 0:
            h.stop_matched = list(s.stop_sequences[stop])
            self.release(d, r, "stop")
        elif len(h.tokens) >= s.max_tokens:
            self.release(d, r, "length")
