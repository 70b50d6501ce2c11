"""The host arrays the engine's step programs take (`make_chunks`, `make_decodes`), and the
step body's names (`decoding.step`; its programs are `decoding.compiled`'s, a set per depth).
"""

from __future__ import annotations

import numpy as np

from ..decoding.step import FILLER, STOPS, Chunks, Decodes, Emitted, Requests  # noqa: F401
from ..model import paged


def make_chunks(tables: list, tokens: list, starts: list, slots: list, finals: list, T: int, R: int,
                rows: int, windows: list = (), mask: np.ndarray | None = None) -> Chunks:
    """Host arrays of a chunk group padded to `rows` rows of T tokens and R page entries
    (windows: each row's cache_window, 0 for none; mask [rows, W]: grammar masks)."""
    tok = np.zeros((rows, T), np.int32)
    for i, t in enumerate(tokens):
        tok[i, :len(t)] = t
    return Chunks(_rows(tables, starts, [len(t) for t in tokens], R, rows, windows), tok, _pad(slots, rows, FILLER),
                  np.asarray(list(finals) + [False] * (rows - len(finals)), bool), mask)


def make_decodes(tables: list, starts: list, slots: list, steps: list, R: int, rows: int,
                 windows: list = (), left: list | None = None, mask: np.ndarray | None = None) -> Decodes:
    """Host arrays of a decode group padded to `rows` rows and R page entries (left: tokens each
    row may still emit, for `decode_steps`; mask [rows, W]: grammar masks, one step)."""
    return Decodes(_rows(tables, starts, [1] * len(tables), R, rows, windows), _pad(slots, rows, FILLER),
                   _pad(steps, rows, 0), None if left is None else _pad(left, rows, 0), mask)


def _pad(values: list, rows: int, fill: int) -> np.ndarray:
    return np.asarray(list(values) + [fill] * (rows - len(values)), np.int32)


def _rows(tables: list, starts: list, n_new: list, R: int, rows: int, windows: list = ()) -> paged.Rows:
    table = np.zeros((rows, R), np.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t[:R]
    return paged.Rows(table, _pad(starts, rows, 0), _pad(n_new, rows, 0), _pad(list(windows), rows, 0))
