"""Reading Hugging Face safetensors folders tensor by tensor (one file, or shards listed in
model.safetensors.index.json), so that loading never holds a second copy of a model."""

from __future__ import annotations

import json
import os
import sys

import jax


class Tensors:
    """The tensors of a folder's safetensors file(s), read one at a time (sharded folders via
    model.safetensors.index.json). `take` marks a tensor used; `unused` lists the rest."""

    def __init__(self, path: str, progress: bool | None = None, strip: str = ""):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            raise ValueError(f"{path!r} has no model.safetensors or model.safetensors.index.json")
        self.where, self._files = {}, {}
        for name in files:
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                raise ValueError(f"{full} is listed in the index but missing")
            try:
                self._files[name] = safe_open(full, framework="flax")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"cannot read {full}: {e}") from e
            # names as the caller uses them: `strip` removed (GPT2LMHeadModel's "transformer.")
            self.where.update({k.removeprefix(strip): (name, k) for k in self._files[name].keys()})
        self.path, self.used = path, set()
        size = sum(os.path.getsize(os.path.join(path, n)) for n in files)
        self.progress = size > 256 * 2**20 if progress is None else progress

    def shape(self, name: str) -> tuple:
        file, key = self.where[name]
        return tuple(self._files[file].get_slice(key).get_shape())

    def read(self, name: str, dtype) -> jax.Array:
        """Tensor `name` as stored (no checks), cast; not marked used."""
        file, key = self.where[name]
        return self._files[file].get_tensor(key).astype(dtype)

    def take(self, name: str, shape: tuple, dtype, transpose: bool = False) -> jax.Array:
        """Tensor `name`, checked against `shape` (as stored), cast, transposed if asked."""
        if name not in self.where:
            raise ValueError(f"tensor {name!r} is missing from {self.path}")
        if self.shape(name) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {self.shape(name)}; config.json implies {tuple(shape)}")
        a = self.read(name, dtype)
        self.used.add(name)
        n, total = len(self.used), len(self.where)
        if self.progress and (n == total or n % max(1, total // 20) == 0):  # about 20 updates
            print(f"\rloading {self.path}: {n}/{total} tensors", end="", file=sys.stderr, flush=True)
        return a.T if transpose else a

    def unused(self, ignore: tuple = ()) -> list[str]:
        """Names never taken (buffers ending in `ignore` or in rotary_emb.inv_freq aside)."""
        skip = ("rotary_emb.inv_freq", *ignore)
        return sorted(k for k in self.where if k not in self.used and not k.endswith(skip))

    def done(self) -> None:
        if self.progress:
            print(file=sys.stderr)
