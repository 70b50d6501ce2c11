"""The native packed-weight kernel (tinyloop_jax/native/qmatmul.cc, an XLA FFI custom call)
against numpy: x @ the dequantized weight, for every packed format, with the weight in GGUF's
order (tiled inside the program) and pre-tiled (`qarray.tile`, as a Model holds it); row counts
around its 6-row passes (AVX-512; 1 with AVX2), its switch to dequantized panels past 16 rows and their 6-row blocks,
widths that leave a partial 64-column tile, narrow matrices also split along K; under vmap (a
batch of rows folded into one call) and inside a while loop, as a decode step runs it; the
AVX2 and portable (non-AVX-512) builds; the tiled layout's round trip; 8-bit activations."""

import os
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinyloop_jax import native
from tinyloop_jax.model import qarray

from quant_blocks import packed, width

# skipped only where the kernel cannot exist (no compiler, another backend, several devices, turned
# off); where it can, a failed build fails `test_the_kernel_is_built_where_it_can_be`
CAN_BUILD = (bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++"))
             and jax.default_backend() == "cpu" and jax.device_count() == 1
             and os.environ.get("TINYLOOP_NATIVE", "1") != "0")
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="the native kernel needs XLA:CPU on one device and a C++ "
                                "compiler (TINYLOOP_NATIVE=0 turns it off)")


def test_the_kernel_is_built_where_it_can_be():
    assert native.available()


def close(got, want):  # within the 1e-4 of the largest value
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())


SHAPES = [(64, 40, 1), (576, 960, 1), (256, 4100, 3), (1536, 576, 5), (96, 130, 6), (96, 130, 9), (1536, 576, 13),
          (576, 960, 16), (128, 48, 17), (96, 200, 40)]
# the formats added with issue 47 share the passes' and panels' code with the first three: one
# shape of each kind (one row, a pass of rows, a partial pass, panels with a partial tile)
CASES = ([(f, *s) for f in ("q8_0", "q4_0", "q4_1") for s in SHAPES]
         + [(f, *s) for f in qarray.FORMATS[3:] for s in (SHAPES[1], SHAPES[3], SHAPES[6], SHAPES[9])])


@pytest.mark.parametrize("fmt,k,n,rows", CASES)
def test_kernel_equals_numpy(fmt, k, n, rows):
    k = width(fmt, k)  # a K-quant's blocks are 256 values
    w, dense = packed(fmt, k, n)
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    close(jax.jit(qarray.matmul)(x, w), x @ dense)
    close(jax.jit(qarray.matmul)(x, qarray.tile(w)), x @ dense)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0", "q4_k"])
def test_head_vmap_and_while_loop(fmt):
    """The head (a transposed [V, D] weight), per-row vmaps (nested, as batched decode runs),
    and a loop-carried input."""
    k = width(fmt, 64)
    head, dense_head = packed(fmt, k, 300, seed=2, transposed=True)
    x = np.random.default_rng(3).standard_normal((2, 3, k)).astype(np.float32)
    close(jax.jit(qarray.head)(x, head), x @ dense_head.T)
    rows = jax.jit(jax.vmap(jax.vmap(lambda r: qarray.head(r[None], head)[0])))(x)
    close(rows, x @ dense_head.T)
    w, dense = packed(fmt, k, k, seed=4)

    def step(i, v):
        return jnp.tanh(qarray.matmul(v, w))
    want = x[0]
    for _ in range(3):
        want = np.tanh(want @ dense)
    close(jax.jit(lambda v: jax.lax.fori_loop(0, 3, step, v))(x[0]), want)


@pytest.mark.parametrize("fmt,k,n,rows", [("q8_0", 576, 960, 16), ("q4_1", 1536, 576, 5), ("q4_k", 256, 300, 40)])
def test_zero_rows_are_skipped_and_come_back_zero(fmt, k, n, rows):
    """Rows of x that are all zeros (a step's filler rows, a chunk's padding) are left out of the
    product and come back as exact zeros; the others are the same as without them (the kernel's
    decode passes, split along K, and its panels past 16 rows); all rows zero: all zeros, and
    8-bit activations likewise."""
    k = width(fmt, k)
    w = qarray.tile(packed(fmt, k, n)[0])
    x = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32)
    dead = np.arange(rows) % 3 == 1
    x[dead] = 0
    x[0, :5] = 0  # (a row with some zeros is not a zero row)
    f = jax.jit(qarray.matmul)
    got = np.asarray(f(x, w))
    assert not got[dead].any()
    np.testing.assert_array_equal(got[~dead], np.asarray(f(x[~dead], w)))
    assert not np.asarray(f(np.zeros_like(x), w)).any()
    w8 = qarray.tile(qarray.with_activations({"w": packed(fmt, k, n)[0]}, "int8")["w"])
    got8 = np.asarray(f(x, w8))
    assert not got8[dead].any()
    np.testing.assert_array_equal(got8[~dead], np.asarray(f(x[~dead], w8)))


def rounded(x: np.ndarray) -> np.ndarray:
    """x [.., K] rounded to 8 bits per 32 inputs, written from the definition (llama.cpp's q8_0 of
    x with a float32 scale): d = max|x| / 127, q = x / d to the nearest integer, ties to even."""
    xb = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d > 0, np.rint(xb * (np.float32(1) / d)), 0)
    return (q * d).astype(np.float32).reshape(x.shape)


# the integer paths (AVX-512 VNNI: q8_0, q4_0, q4_1 at <= 16 rows) and the float ones (panels, the
# other formats) over one rows' rounding
# (one row, a split along K with a partial pass, 16 rows, 40 rows split by rows with a partial tile)
INT8_CASES = ([(f, *s) for f in ("q8_0", "q4_0", "q4_1") for s in (SHAPES[1], SHAPES[3], SHAPES[7], SHAPES[9])]
              + [(f, *SHAPES[3]) for f in ("q5_1", "q4_k", "q6_k")])


@pytest.mark.parametrize("fmt,k,n,rows", INT8_CASES)
def test_8bit_activations_equal_numpy(fmt, k, n, rows):
    """act="int8": x rounded to 8 bits per 32, then the product, by the kernel (integers where the
    CPU has VNNI) and by XLA's dequantize + dot (`tile`: the path meshes and GPUs take) alike; a
    row of zeros stays zero; the float product is measurably different (the rounding happened)."""
    k = width(fmt, k)
    w, dense = packed(fmt, k, n)
    w8 = qarray.with_activations({"w": w}, "int8")["w"]
    x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0
    want = rounded(x) @ dense
    close(jax.jit(qarray.matmul)(x, qarray.tile(w8)), want)
    close(jax.jit(lambda v: qarray.matmul(v, w8, tile=1 << 30))(x), want)
    assert np.abs(x @ dense - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q5_0"])
def test_8bit_activations_head_and_vmap(fmt):
    """The head's product and a vmap over rows (a decode step's batch folded into one call), with
    8-bit activations."""
    head, dense_head = packed(fmt, 64, 300, seed=2, transposed=True)
    head = qarray.tile(qarray.with_activations({"h": head}, "int8")["h"])
    x = np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32)
    want = rounded(x) @ dense_head.T
    close(jax.jit(qarray.head)(x, head), want)
    close(jax.jit(jax.vmap(jax.vmap(lambda r: qarray.head(r[None], head)[0])))(x), want)


def test_activations_are_checked():
    w, _ = packed("q4_1", 64, 64)
    with pytest.raises(ValueError, match="activations='int4'"):
        qarray.with_activations({"w": w}, "int4")


def test_a_failed_build_is_a_runtime_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYLOOP_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        native.build()
    assert not any(p.name.endswith(".so") for p in (tmp_path / "native").iterdir())  # nothing half-written


@pytest.mark.parametrize("fmt", qarray.FORMATS)
def test_tiled_layout_is_the_same_bytes(fmt):
    """tile -> canonical gives GGUF's order back bit for bit (the last tile's padding dropped);
    a tiled weight dequantizes, looks up rows and keeps its logical shape as before."""
    k = width(fmt, 96)
    w = qarray.reshape_out(packed(fmt, k, 120)[0], 3, 40)
    t = qarray.tile(w)
    assert t.q.shape[0] == 2 and t.shape == w.shape == (k, 3, 40) and t.k == k  # 120 columns: 2 tiles
    back = qarray.canonical(t)
    for field in ("q", "scale", "min"):
        a, b = getattr(w, field), getattr(back, field)
        assert (a is None) == (b is None) and (a is None or np.array_equal(np.asarray(a), np.asarray(b)))
    np.testing.assert_array_equal(np.asarray(t.dequantize()), np.asarray(w.dequantize()))
    e, _ = packed(fmt, width(fmt, 64), 200, seed=5, transposed=True)  # an embedding [200, k]
    rows = jnp.asarray([0, 63, 64, 199, 130])
    np.testing.assert_array_equal(np.asarray(qarray.take(qarray.tile(e), rows)), np.asarray(qarray.take(e, rows)))


PORTABLE = textwrap.dedent("""
    import sys
    import numpy as np, jax
    from tinyloop_jax import native
    from tinyloop_jax.model import qarray
    sys.path.insert(0, sys.argv.pop(1))  # tests/
    from quant_blocks import packed, width
    native.FLAGS.extend(sys.argv[1:])  # fewer instruction sets than -march=native gives
    native.build()  # a RuntimeError with the compiler's output if it fails
    assert native.available(), (jax.default_backend(), jax.device_count(), native._state)
    # one row (decode), a few (passes of rows), past 16 (panels, with partial register blocks
    # and a partial last tile)
    for fmt in qarray.FORMATS:
        for k, n, rows in [(64, 40, 1), (576, 960, 1), (96, 130, 5), (96, 200, 12), (96, 130, 23), (64, 40, 40)]:
            k = width(fmt, k)
            w, dense = packed(fmt, k, n)
            x = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
            want = x @ dense
            got = np.asarray(jax.jit(qarray.matmul)(x, qarray.tile(w)))
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), (fmt, k, n, rows)
            w8 = qarray.with_activations({"w": qarray.tile(w)}, "int8")["w"]
            want = np.asarray(jax.jit(lambda v: qarray.matmul(v, w, tile=1 << 30))(qarray.round_activations(x)))
            got = np.asarray(jax.jit(qarray.matmul)(x, w8))
            assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), ("int8", fmt, k, n, rows)
    print("ok")
""")


@pytest.mark.parametrize("flags", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2"]], ids=["avx2", "portable"])
def test_the_narrower_builds_equal_numpy(flags):
    """Where the CPU has no AVX-512 the kernel runs its AVX2 vectors (8 lanes: x86-64 CPUs of the
    last decade), and without AVX2 its plain C++ loops: each built here with those instruction
    sets turned off (its own file: the flags are in the build's key), in a fresh process. (On a
    CPU without AVX2 both builds are the portable one.) Each also with 8-bit activations, which
    without AVX-512 VNNI (neither build has it) are rounded and multiplied in float."""
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1"}  # one device (tests/mesh_checks.py, imported by
    env.pop("TINYLOOP_NATIVE", None)                   # test_mesh, sets 8 for its worker's children)
    r = subprocess.run([sys.executable, "-c", PORTABLE, os.path.dirname(__file__), *flags], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
