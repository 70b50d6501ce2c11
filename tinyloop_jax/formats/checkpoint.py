"""Orbax-backed folders of named arrays plus a JSON record, written atomically.

    <path>/
      tinyloop.json   {"kind": ..., "format": 1, "digests": {name: sha256}, ...caller's meta}
      arrays/         orbax PyTree checkpoint of {name: np.ndarray}

A save goes to a temporary sibling folder and is renamed into place only when complete, so
a failed save leaves nothing half-written. A load checks the kind, that every array is
present with the recorded shape/dtype, and every digest: a truncated, corrupted or foreign
folder is an error, never a wrong result.

A model's record also holds its config and weight layout (`params.LAYOUT`); a model saved
before layouts were recorded holds layout 1 and is converted on load (`load_model`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import numpy as np

from ..model.config import ModelConfig
from ..model.params import (LAYOUT, Params, from_flat_layout, host_leaves, named_leaves, pack_arrays, quant_formats,
                            unflatten)

FORMAT = 1
META_FILE = "tinyloop.json"


def _digest(a: np.ndarray) -> str:
    h = hashlib.sha256(str((a.shape, a.dtype.str)).encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()



def _checkpointer():
    """orbax's checkpointer, imported on first use: orbax holds ~25 MiB once imported, which a
    process that never reads or writes a checkpoint (a server of a GGUF file) need not pay."""
    import orbax.checkpoint as ocp

    return ocp.PyTreeCheckpointer()


def save(path: str, kind: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path):
        raise ValueError(f"{path} already exists; choose a new path or remove it first")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=parent)
    try:
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        _checkpointer().save(os.path.join(tmp, "arrays"), arrays)
        record = dict(meta, kind=kind, format=FORMAT,
                      shapes={k: [list(a.shape), a.dtype.str] for k, a in arrays.items()},
                      digests={k: _digest(a) for k, a in arrays.items()})
        with open(os.path.join(tmp, META_FILE), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_meta(path: str, kind: str) -> dict:
    path = os.path.abspath(os.fspath(path))
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"{path} is not a folder")
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path} is not a tinyloop {kind} checkpoint (no {META_FILE})")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"{meta_path} is unreadable or corrupted: {e}") from e
    if meta.get("kind") != kind:
        raise ValueError(f"{path} holds a {meta.get('kind')!r} checkpoint, not a {kind!r} one")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} has checkpoint format {meta.get('format')!r}; this version reads {FORMAT}")
    return meta


def load(path: str, kind: str) -> tuple[dict[str, np.ndarray], dict]:
    meta = read_meta(path, kind)
    path = os.path.abspath(os.fspath(path))
    try:
        restored = _checkpointer().restore(os.path.join(path, "arrays"))
    except Exception as e:  # noqa: BLE001 - orbax raises many types for damaged folders
        raise RuntimeError(f"{path}: arrays could not be read (truncated or corrupted checkpoint): {e}") from e
    arrays = {}
    for name, (shape, dtype) in meta["shapes"].items():
        if name not in restored:
            raise RuntimeError(f"{path}: array {name!r} is missing (truncated checkpoint)")
        a = np.asarray(restored[name])
        if list(a.shape) != shape or a.dtype.str != dtype:
            raise RuntimeError(f"{path}: array {name!r} has shape {a.shape} {a.dtype}, recorded {shape} {dtype}")
        if _digest(a) != meta["digests"][name]:
            raise RuntimeError(f"{path}: array {name!r} does not match its recorded digest (corrupted checkpoint)")
        arrays[name] = a
    return arrays, meta


def flatten(tree) -> dict[str, np.ndarray]:
    """A pytree of arrays (dicts, lists, dataclasses) -> {"a.0.k": np.ndarray}, keyed by tree path."""
    return {k: np.asarray(v) for k, v in named_leaves(tree).items()}


def save_model(path: str, params: Params, config: ModelConfig) -> None:
    """A model's weights (keyed by tree path; on the host, without a mesh's padding, see
    `params.host_leaves`), config and weight layout, as a "model" checkpoint."""
    meta = {"config": config.to_dict(), "layout": LAYOUT}
    formats = quant_formats(params)
    if formats:  # packed weights (see `qarray`): each stored as its fields
        meta["quantized"] = formats
    save(path, "model", dict(host_leaves(params, config)), meta)


def load_model(path: str) -> tuple[Params, ModelConfig]:
    """A "model" checkpoint -> (Params in this layout, ModelConfig); layout 1 (a checkpoint
    without a recorded layout) is converted with `params.from_flat_layout`."""
    arrays, meta = load(path, "model")
    config = ModelConfig.from_dict(meta["config"])
    layout = meta.get("layout", 1)
    if layout not in (1, LAYOUT):
        raise ValueError(f"{path} has weight layout {layout!r}; this version reads layouts 1 and {LAYOUT}")
    if layout == 1:
        arrays = {name: from_flat_layout(name, a, config) for name, a in arrays.items()}
    return unflatten(pack_arrays(arrays, meta.get("quantized", {})), config), config
