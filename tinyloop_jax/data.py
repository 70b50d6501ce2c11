"""The bundled model's text: Python's own `pydoc_data.topics`, with a fixed 5% held out."""

from __future__ import annotations

import numpy as np

CHUNK = 2048  # every 20th chunk of this many bytes is validation: a fixed, spread-out 5%


def pydoc_bytes() -> bytes:
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")


def pydoc_split() -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) byte arrays (uint8 token ids 0..255)."""
    data = np.frombuffer(pydoc_bytes(), np.uint8)
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    val = np.concatenate([c for i, c in enumerate(chunks) if i % 20 == 19])
    train = np.concatenate([c for i, c in enumerate(chunks) if i % 20 != 19])
    return train, val
