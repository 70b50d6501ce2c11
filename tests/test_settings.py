"""The package's surroundings, read in one place (`settings.py`): its environment variables, each in
the docs, and the C heap's free memory handed back."""

import ctypes
import ctypes.util
import pathlib
import re
import subprocess
import sys

import pytest

from tinyloop_jax import settings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_variable_the_code_names_is_listed_and_documented():
    """Every `TINYLOOP_*` name in the package's source is in `settings.VARIABLES`, and every
    listed one has its row in docs/reference.md; `model/` reads no environment and no /proc."""
    named = set()
    for path in (ROOT / "tinyloop_jax").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"\bTINYLOOP_[A-Z0-9_]+\b", text))
        if path.parent.name == "model":
            assert "os.environ" not in text and "/proc" not in text, path
    assert named <= set(settings.VARIABLES), named - set(settings.VARIABLES)
    doc = (ROOT / "docs" / "reference.md").read_text()
    for name, (default, _) in settings.VARIABLES.items():
        assert f"| `{name}` | {settings.cell(default)} |" in doc, name


def test_a_variable_reads_its_default_and_refuses_unknown_names(monkeypatch):
    monkeypatch.delenv("TINYLOOP_PAGED_KERNEL", raising=False)
    assert settings.get("TINYLOOP_PAGED_KERNEL") == "auto"
    monkeypatch.setenv("TINYLOOP_PAGED_KERNEL", "xla")
    assert settings.get("TINYLOOP_PAGED_KERNEL") == "xla"
    try:
        settings.get("TINYLOOP_NO_SUCH")
    except KeyError as e:
        assert "TINYLOOP_NO_SUCH" in str(e)
    else:
        raise AssertionError("an unknown variable was read")


def test_released_memory_leaves_the_process():
    """`release_free_memory` returns the C heap's free pages to the system, as a compile leaves
    them: 200 MB of small blocks freed below one still held (so free() alone cannot shrink the
    heap) stay resident until it runs, and most of them leave then."""
    libc = ctypes.util.find_library("c")
    if not libc or not hasattr(ctypes.CDLL(libc), "malloc_trim"):
        pytest.skip("no glibc malloc_trim on this system: release_free_memory does nothing here")
    libc = ctypes.CDLL(libc)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]

    def resident() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))

    blocks = [libc.malloc(2000) for _ in range(100_000)]
    for b in blocks:
        ctypes.memset(b, 1, 2000)
    for b in blocks[:-1]:
        libc.free(b)
    before = resident()
    assert settings.release_free_memory()
    freed = before - resident()
    libc.free(blocks[-1])
    assert freed > 100e6, freed


def test_forgotten_programs_leave_and_orbax_waits_for_a_checkpoint():
    """`forget_programs` drops what JAX holds compiled (the next call compiles again), and
    importing the package, its server included, loads no orbax (~25 MiB) until a checkpoint is
    read or written: what `tinyloop serve` of a GGUF file keeps out of its peak. In a process of
    its own, so the suite's caches are left alone."""
    code = """
import sys
import jax, jax.numpy as jnp
import tinyloop_jax
from tinyloop_jax.serving import app, engine
from tinyloop_jax import settings
assert "orbax" not in sys.modules and "orbax.checkpoint" not in sys.modules
f = jax.jit(lambda x: x * 2)
f(jnp.ones(3))
assert f._cache_size() == 1
settings.forget_programs()
assert f._cache_size() == 0
from tinyloop_jax.formats import checkpoint
checkpoint._checkpointer()
assert "orbax.checkpoint" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_the_servers_jemalloc_is_chosen_by_its_variable(monkeypatch, tmp_path):
    """`TINYLOOP_JEMALLOC`: 0 turns the server's allocator off, a path is taken as it is, auto
    finds an installed libjemalloc or ray's copy (the test extra installs ray, so one is found
    here). Whether `tinyloop serve` then runs under it: tests/test_server.py's memory sweep."""
    monkeypatch.setenv("TINYLOOP_JEMALLOC", "0")
    assert settings.jemalloc() is None
    with pytest.raises(ValueError, match="no-such.so"):
        monkeypatch.setenv("TINYLOOP_JEMALLOC", str(tmp_path / "no-such.so"))
        settings.jemalloc()
    (tmp_path / "libjemalloc.so").write_bytes(b"")
    monkeypatch.setenv("TINYLOOP_JEMALLOC", str(tmp_path / "libjemalloc.so"))
    assert settings.jemalloc() == str(tmp_path / "libjemalloc.so")
    monkeypatch.setenv("TINYLOOP_JEMALLOC", "auto")
    found = settings.jemalloc()
    assert found and "jemalloc" in found
    assert settings.loaded("libc") and not settings.loaded("no-such-library")
