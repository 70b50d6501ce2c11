"""Tokenizers: the bundled model's bytes (UTF-8 bytes are ids 0..255, then a few special ids),
and a Hugging Face folder's tokenizer.json through the `tokenizers` package."""

from __future__ import annotations

import os

import numpy as np


class ByteTokenizer:
    """>>> tok = ByteTokenizer(); tok.decode(tok.encode("héllo"))
    'héllo'
    """

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 260  # 256 bytes + BOS, EOS, PAD + one spare

    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False) -> np.ndarray:
        """str -> np.ndarray[int32] of byte ids (optionally wrapped in BOS/EOS; `special` is
        accepted for HFTokenizer's interface: the bundled model was trained without BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return np.array(([self.BOS] if bos else []) + ids + ([self.EOS] if eos else []), np.int32)

    def decode(self, ids) -> str:
        """Token ids -> str. Special and out-of-range ids are dropped, invalid UTF-8 is replaced
        (U+FFFD); this never raises on integer input."""
        data = bytes(int(i) for i in np.asarray(ids, np.int64).ravel() if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A folder's tokenizer.json (any model Hugging Face's `tokenizers` reads). Same interface
    as ByteTokenizer: encode(str) -> int32 ids, decode(ids) -> str (special tokens dropped)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"{path!r} has no tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
            raise ValueError(f"cannot read {file}: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> np.ndarray:
        """str -> np.ndarray[int32]; special=True adds the tokenizer's own special tokens (BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        return np.array(self._tok.encode(text, add_special_tokens=special).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids, np.int64).ravel()], skip_special_tokens=True)


def tokenizer_for(path: str | None):
    """The tokenizer of a model folder: tokenizer.json if it has one, else the byte tokenizer
    (the bundled model and tinyloop checkpoints)."""
    if path is not None and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    return ByteTokenizer()
