"""The step's output: a dispatched step's tokens read back, each emitted to its `Handle` with the
stop sequence the step found it to end (-1: none); rows finishing at a stop, at max_tokens or
where their grammar ends leave their `Depth` and are kept for the engine (`take_finished`).
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
import numpy as np

from .depth import Depth, Row, namespace
from .handles import Handle
from ..decoding.grammar import take


class Output:
    """The batcher's output room: `read` a step's tokens, `emit` one, `release` a row.
    stats and depth_counts: the batcher's counters (shared); on_first_token: called with a
    request's handle at its first token; prefix_cache: a leaving row's pages stay indexed."""

    def __init__(self, cfg, stats: collections.Counter, depth_counts: dict, on_first_token: Callable[[Handle], None],
                 prefix_cache: bool = True):
        self.cfg, self.stats, self.depth_counts = cfg, stats, depth_counts
        self._on_first_token, self.prefix_cache = on_first_token, prefix_cache
        self.finished: list = []  # (handle, reason, error) of the rows that left, for the engine

    def read(self, d: Depth, ran: list) -> None:
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
                    self.emit(d, r, int(got.tokens[i]), int(got.stops[i]))
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
                    self.emit(d, r, t, int(stops[i, j]), wake=False)
            r.handle.wake()

    def emit(self, d: Depth, r: Row, t: int, stop: int, wake: bool = True) -> None:
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

    def release(self, d: Depth, r: Row, reason: str, error: BaseException | None = None) -> None:
        """Row r leaves (its request finishes with `reason`): its pages and request row are free
        (its prompt's pages stay cached in the index)."""
        if r.left:
            return
        r.left = True
        d.leave(r, self.prefix_cache, namespace(self.cfg, r.handle))
        self.finished.append((r.handle, reason, error))
        self.stats[f"finished_{reason}"] += 1

    def take_finished(self) -> list:
        out, self.finished = self.finished, []
        return out
