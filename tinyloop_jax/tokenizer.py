"""Byte-level tokenizer: UTF-8 bytes are ids 0..255, then a few special ids."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """>>> tok = ByteTokenizer(); tok.decode(tok.encode("héllo"))
    'héllo'
    """

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 260  # 256 bytes + BOS, EOS, PAD + one spare

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> np.ndarray:
        """str -> np.ndarray[int32] of byte ids (optionally wrapped in BOS/EOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return np.array(([self.BOS] if bos else []) + ids + ([self.EOS] if eos else []), np.int32)

    def decode(self, ids) -> str:
        """Token ids -> str. Special and out-of-range ids are dropped, invalid UTF-8 is replaced
        (U+FFFD); this never raises on integer input."""
        data = bytes(int(i) for i in np.asarray(ids, np.int64).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")
