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
            R = self.table_len(max(starts) + k + 1)
            bd = next(b for b in batch_buckets(self.max_batch) if b >= len(rows))
            decodes = S.make_decodes([r.pages for r in rows], starts, [r.slot for r in rows],
                                     [len(r.handle.tokens) for r in rows], R, bd, [r.handle.cache_window for r in rows])
            for r, q in zip(rows, starts):
                self._window(d, r, q, k + 1)
            self._sync(d)
            w = self.model.weights
            tokens, kept, d.pool, d.state = self._run(
                ("speculate", d.loops, spec, bd, R), self.jits(d.loops)["step_speculative"], w.params, w.config,
                d.pool, d.state, decodes, loops=d.loops, draft_loops=spec.draft_loops, lookahead=k, exit=d.exit)
            tokens, kept = jax.tree.map(np.asarray, tokens), np.asarray(kept)
            self.stats["speculative_rounds"] += 1
            self.stats["batch_rows"] += len(rows)
            counts["tokens_computed"] += len(rows) * (k + 1)
            counts["passes"] += len(rows) * (k * spec.draft_loops + (k + 1) * d.loops)
            for i, r in enumerate(rows):
                r.handle.drafted += k
                r.handle.accepted += int(kept[i])
                for t, stop in zip(tokens.tokens[i, :kept[i] + 1], tokens.stops[i]):
                    if r.left:  # a stop or max_tokens cut the round: the rest is discarded
                        break
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
            if many:  # (`decode_steps`) its k tokens, up to a stop; its readers woken once
                r.ahead -= many[0]
                got = get(tok)
                for t, stop in zip(got.tokens[i, :many[0]], got.stops[i]):
                    if r.left:
                        break
                    self._emit(d, r, int(t), int(stop), wake=False)
                r.handle.wake()
                continue
            r.ahead -= 1
            if passes is not None:
                p = int(get(passes)[i])
                counts["passes"] += p
                counts["passes_skipped"] += d.loops - p
                if not r.left and r.handle.policy is not None:
                    r.handle.depths.append(p)
            if not r.left:
                got = get(tok)
                self._emit(d, r, int(got.tokens[i]), int(got.stops[i]))

    def _emit(self, d: Depth, r: Row, t: int, stop: int, wake: bool = True) -> None:
        """Token t of row r, which the step found to end its stop sequence `stop` (-1: none)."""
        h, s = r.handle, r.handle.params
        h.emit(t, wake)
        self.stats["tokens_out"] += 1
        if len(h.tokens) == 1:
            self._on_first_token(h)
        if stop >= 0:
            h.stop_matched = list(s.stop_sequences[stop])
            self.release(d, r, "stop")
        elif len(h.tokens) >= s.max_tokens:
            self.release(d, r, "length")
