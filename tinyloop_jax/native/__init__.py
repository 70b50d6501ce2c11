"""Native kernels for XLA:CPU, built on first use with the machine's C++ compiler.

`qmatmul.cc` is an XLA FFI custom call: x [..., K] float32 @ a weight kept in GGUF's q8_0 /
q4_0 / q4_1 blocks (qarray's layout) -> [..., N] float32, reading the packed bytes once per
call (XLA:CPU has no such dot: it writes the dequantized float32 matrix and reads it again, or
hoists that copy out of the decode loop; docs/benchmarks.md, issue 23). `paged_attention.cc` is
another: a step's queries against each row's live KV pages only (`model.paged`'s reference
gathers a row's whole page table).

Built like a JIT extension (torch's `cpp_extension.load`, Triton): `g++ -O3 -march=native`
against the FFI headers jaxlib ships, into `$TINYLOOP_HOME/native/` under a key of the source,
the flags, jaxlib's version and the CPU, written atomically, loaded with ctypes and registered
once per process. Where it cannot be used — no compiler, a failed build (warned once), another
backend, several devices (a mesh: the custom call has no sharding rule), or
`TINYLOOP_NATIVE=0` — `available()` is False and qarray dequantizes inside the program as
before.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from .. import settings

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(HERE, "qmatmul.cc"), os.path.join(HERE, "paged_attention.cc")]
HEADERS = [os.path.join(HERE, n) for n in ("qsimd.h", "qformats.h", "spinners.h")]  # qmatmul.cc's
SOURCE = SOURCES[0]
TARGET = "tinyloop_qmatmul"
PAGED_TARGET = "tinyloop_paged_attention"
PAGE_FORMATS = {"fp32": 0, "fp16": 1, "int8": 2, "int4": 3}
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", "-fopenmp-simd", "-fno-math-errno"]
FORMATS = {"q8_0": 0, "q4_0": 1, "q4_1": 2, "q5_0": 3, "q5_1": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7}
ACTIVATIONS = ("float32", "int8")  # qmatmul's `act`: the inputs as given, or rounded to 8 bits per 32

_lock = threading.Lock()
_state: dict = {}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


def library_path() -> str:
    """Where the built kernel for this source, compiler flags, jaxlib and CPU lives."""
    from ..formats.hub import home

    import jaxlib
    text = b"".join(open(src, "rb").read() for src in SOURCES + HEADERS)
    key = hashlib.sha256(text + " ".join(FLAGS).encode() + jaxlib.__version__.encode()
                         + _cpu().encode()).hexdigest()[:16]
    return os.path.join(home(), "native", f"qmatmul-{key}.so")


def build() -> str:
    """Compile the kernel if it is not built yet; returns the library's path. RuntimeError
    (with the compiler's output) if there is no compiler or the build fails."""
    out = library_path()
    if os.path.exists(out):
        return out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build the packed-weight kernel")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        try:
            r = subprocess.run([cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp],
                               capture_output=True, text=True)
        except OSError as e:
            raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from e
        if r.returncode:
            raise RuntimeError(f"building {' '.join(SOURCES)} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # whole or not at all: another process may be building it too
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


def available() -> bool:
    """Whether packed matmuls run through the kernel in this process (see the module doc)."""
    if settings.get("TINYLOOP_NATIVE") == "0" or jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    with _lock:
        if "ok" not in _state:
            try:
                lib = ctypes.cdll.LoadLibrary(build())
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.TinyloopQMatmul), platform="cpu")
                jax.ffi.register_ffi_target(PAGED_TARGET, jax.ffi.pycapsule(lib.TinyloopPagedAttention),
                                            platform="cpu")
                _state["ok"] = True
            except (OSError, RuntimeError) as e:
                warnings.warn(f"packed weights fall back to XLA's dequantize + dot: {e}", RuntimeWarning)
                _state["ok"] = False
        return _state["ok"]


def _call(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array, layer: jax.Array, fmt: str, n: int,
          act: str) -> jax.Array:
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32))(
        x.astype(jnp.float32), q, d, m, jnp.asarray(layer, jnp.int32).reshape(1), fmt=np.int32(FORMATS[fmt]),
        act=np.int32(ACTIVATIONS.index(act)))


def _kernel(fmt: str, n: int, dense, act: str):
    """The custom call as a function that vmap folds into its rows: a batch of rows is more
    rows of x (the weight is shared), so a decode step over 16 requests is one call."""

    @jax.custom_batching.custom_vmap
    def f(x, q, d, m, layer):
        return _call(x, q, d, m, layer, fmt, n, act)

    @f.def_vmap
    def rule(axis_size, in_batched, x, q, d, m, layer):
        if any(in_batched[1:]):  # a weight per row: not this kernel's case
            axes = [0 if b else None for b in in_batched]
            return jax.vmap(dense, in_axes=axes)(x, q, d, m, layer), True
        if not in_batched[0]:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return f(x, q, d, m, layer), True

    return f


_kernels: dict = {}


def qmatmul(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array | None, fmt: str, n: int, dense,
            act: str = "float32", layer: jax.Array | int | None = None) -> jax.Array:
    """x [..., K] @ a packed [K, n] weight in qarray's kernel layout (`qarray.tile`: q [C, K/S,
    R, 64], d and m [C, K/S, 64], C = ceil(n / 64); m None for formats without one) -> float32 [..., n].
    `layer`: q, d and m are a stack of L such weights ([L, C, ...]) and the product is with entry
    `layer` (int32 [], traced in a layer loop), read in place. `dense(x, q, d, m, layer)`: the
    same product through XLA, for a vmap that batches the weight itself (it rounds x itself
    where act is "int8"). `act`: "float32", or "int8": each row's inputs rounded to 8 bits per
    32 (`qarray.round_activations`) and, where the CPU has AVX-512 VNNI, multiplied as integers
    (Q8_0, Q4_0, Q4_1)."""
    if (fmt, n, act) not in _kernels:
        _kernels[fmt, n, act] = _kernel(fmt, n, dense, act)
    return _kernels[fmt, n, act](x, q, d, d if m is None else m, jnp.int32(0) if layer is None else layer)


def paged_attention(q: jax.Array, k: jax.Array, v: jax.Array, ks: jax.Array | None, vs: jax.Array | None,
                    table: jax.Array, start: jax.Array, n_new: jax.Array, layer: jax.Array, fmt: str, window,
                    kv_heads: int) -> jax.Array:
    """Each row's queries q [b, T, H, hd] (pre-scaled; query t at position start[r] + t, real for
    t < n_new[r]) against its live pages only: k, v a layer's pages [.., KV, NP, P, w] (or a
    stack of layers, `layer` [] int32 choosing one of its leading entries), ks, vs their
    per-token scales (int formats), table [b, R], window an int or [b] (each row's; <= 0: none)
    -> float32 [b, T, H, hd] (see paged_attention.cc). Call only where `available()`."""
    if ks is None:
        ks = vs = jnp.zeros((1,), jnp.float32)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    windows = jnp.broadcast_to(i32(window), (q.shape[0],))
    return jax.ffi.ffi_call(PAGED_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q.astype(jnp.float32), k, v, ks, vs, i32(table), i32(start), i32(n_new), windows, i32(layer).reshape(1),
        fmt=np.int32(PAGE_FORMATS[fmt]), kv_heads=np.int32(kv_heads))
