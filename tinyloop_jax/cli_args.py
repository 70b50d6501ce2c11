"""The command line's argument types: each turns a flag's text into its value, or raises
`argparse.ArgumentTypeError` naming what was expected (argparse then exits 2 with it)."""

from __future__ import annotations

import argparse


def kv_share(text: str) -> str:
    from .model.kv_share import parse

    try:
        return str(parse(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def byte_count(text: str) -> int | str | None:
    """A byte count ("512M", "2G", "1048576"), "auto" or "none"."""
    t = text.strip().lower()
    if t in ("auto", "none"):
        return None if t == "none" else "auto"
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 512M, 2G), auto or none, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return n


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def pairs(text: str) -> tuple:
    """'1:4,2:3' -> ((1, 4), (2, 3)): draft_loops:lookahead pairs."""
    try:
        pairs = tuple(tuple(int(x) for x in p.split(":")) for p in text.split(",") if p.strip())
    except ValueError:
        pairs = ((),)
    if not all(len(p) == 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected draft_loops:lookahead pairs such as 1:4,2:3, got {text!r}")
    return pairs
