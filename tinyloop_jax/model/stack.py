"""Layers of one structure kept as one stack, so that a program runs them in a loop (`lax.fori_loop`
over a layer index) instead of unrolling them: a program's size, its compile time and the
memory its compiled code keeps then do not grow with the depth (SmolLM2's 29 pre blocks:
docs/benchmarks.md, "Warmup and memory").

`Stacked(tree)`: n blocks as one block whose every array has a leading [n] axis. Layer i is a
view (`at`): a packed weight keeps the stack's fields and names its layer (`QuantArray.layer`,
which the native kernel reads in place: no copy of a layer's bytes a step), a float array is
sliced. Indexing and iteration give the views too, so code written over a tuple of blocks
reads a stack unchanged; what a checkpoint or a fingerprint sees is `unstacked` (a tuple).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .qarray import is_quant


@struct.dataclass
class Stacked:
    tree: object  # a block (`BlockParams` | `LlamaBlock`), every array [n, ...]

    def __len__(self) -> int:
        return int(jax.tree.leaves(self.tree)[0].shape[0])

    def at(self, i):
        """Layer i (an int, or int32 [] traced in a layer loop) as a block (module doc)."""
        def pick(a):
            if is_quant(a):
                return a.replace(layer=jnp.asarray(i, jnp.int32))
            return a[i] if isinstance(i, int) else jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)
        return jax.tree.map(pick, self.tree, is_leaf=is_quant)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return tuple(self)[j]
        return self.at(range(len(self))[j])

    def __iter__(self):
        return (self.at(j) for j in range(len(self)))


def is_stacked(blocks) -> bool:
    return isinstance(blocks, Stacked)


def stack(blocks: tuple):
    """A tuple of blocks as a `Stacked` when they share one structure (the same fields, static
    fields — a block's window and RoPE base —, packed formats, shapes and dtypes) and there are
    at least two; else the tuple as it is."""
    blocks = tuple(blocks)
    if len(blocks) < 2:
        return blocks
    first = jax.tree.structure(blocks[0])
    shape = lambda b: [(a.shape, a.dtype) for a in jax.tree.leaves(b)]  # noqa: E731
    if any(jax.tree.structure(b) != first or shape(b) != shape(blocks[0]) for b in blocks[1:]):
        return blocks
    return Stacked(jax.tree.map(lambda *a: jnp.stack(a), *blocks))


def read_in_place(blocks) -> bool:
    """Would a layer loop read these blocks' matrices where they lie? Packed weights, yes (the
    native kernel takes the stack and a layer index); a float matrix is copied out of the stack
    at every layer (XLA:CPU slices a dot's operand): SmolLM2 dequantized to float32 decoded at
    42.8 ms a token stacked against 28.6 unrolled, and 6.7x slower under the suite's
    unoptimized XLA flags (docs/benchmarks.md, "Which blocks loop"). Vectors (norms) are cheap
    to slice either way."""
    leaves = jax.tree.leaves(tuple(blocks), is_leaf=is_quant)
    return all(is_quant(a) for a in leaves if a.ndim >= 2)


def unstacked(blocks) -> tuple:
    """Blocks as a tuple of blocks with arrays of their own (a stack's layers sliced out, a
    view's packed weights too)."""
    own = lambda b: jax.tree.map(lambda a: a.own() if is_quant(a) else a, b, is_leaf=is_quant)  # noqa: E731
    return tuple(own(b) for b in blocks)
