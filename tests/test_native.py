"""The native packed-weight kernel (tinyloop_jax/native/qmatmul.cc, an XLA FFI custom call)
against numpy: x @ the dequantized weight, for every packed format, row counts around its
4-row tiles and its MAX_ROWS switch to XLA's dot, widths that leave partial 16-column vectors,
narrow matrices split along K and wide ones split into column tiles; under vmap (a batch of
rows folded into one call) and inside a while loop, as a decode step runs it."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinyloop_jax import native
from tinyloop_jax.model import qarray

# skipped only where the kernel cannot exist (no compiler, another backend, several devices, turned
# off); where it can, a failed build fails `test_the_kernel_is_built_where_it_can_be`
CAN_BUILD = (bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
             and jax.default_backend() == "cpu" and jax.device_count() == 1
             and os.environ.get("TINYLOOP_NATIVE", "1") != "0")
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the native kernel needs XLA:CPU on one device and a C++ "
                                "compiler (TINYLOOP_NATIVE=0 turns it off)")


def test_the_kernel_is_built_where_it_can_be():
    assert native.available()


def packed(fmt: str, k: int, n: int, seed: int = 0, transposed: bool = False):
    w = np.random.default_rng(seed).standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    q = qarray.quantize(w, fmt, transposed=transposed)
    return q, np.asarray(q.dequantize())


def close(got, want):  # within the 1e-4 of the largest value
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("fmt", qarray.FORMATS)
@pytest.mark.parametrize("k,n,rows", [(64, 40, 1), (576, 960, 1), (256, 4100, 3), (1536, 576, 5), (96, 130, 9),
                                      (128, 48, 17), (96, 200, 40)])
def test_kernel_equals_numpy(fmt, k, n, rows):
    w, dense = packed(fmt, k, n)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    close(jax.jit(qarray.matmul)(x, w), x @ dense)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_head_vmap_and_while_loop(fmt):
    """The head (a transposed [V, D] weight), per-row vmaps (nested, as batched decode runs),
    and a loop-carried input."""
    head, dense_head = packed(fmt, 64, 300, seed=2, transposed=True)
    x = np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32)
    close(jax.jit(qarray.head)(x, head), x @ dense_head.T)
    rows = jax.jit(jax.vmap(jax.vmap(lambda r: qarray.head(r[None], head)[0])))(x)
    close(rows, x @ dense_head.T)
    w, dense = packed(fmt, 64, 64, seed=4)

    def step(i, v):
        return jnp.tanh(qarray.matmul(v, w))
    want = x[0]
    for _ in range(3):
        want = np.tanh(want @ dense)
    close(jax.jit(lambda v: jax.lax.fori_loop(0, 3, step, v))(x[0]), want)


def test_a_failed_build_is_a_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYLOOP_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        native.build()
    assert not any(p.name.endswith(".so") for p in (tmp_path / "native").iterdir())  # nothing half-written
