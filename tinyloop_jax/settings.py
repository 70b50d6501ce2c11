"""What the package reads from its surroundings, read here only: the environment variables (each
with its default and meaning) and the memory the host or device can still hand out (and the C
heap's free pages, handed back). The model's code (`model/`) asks this module; it never reads
the environment or `/proc` itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os

# name -> (default, what it does)
VARIABLES = {
    "TINYLOOP_HOME": ("~/.cache/tinyloop", "where models, side venvs and llama.cpp builds are kept"),
    "TINYLOOP_API_KEY": ("", "`tinyloop serve --api-key`'s default"),
    "TINYLOOP_NATIVE": ("1", "0: no native CPU kernels (the XLA reference for packed weights and paged attention)"),
    "TINYLOOP_PAGED_KERNEL": ("auto", "paged attention: auto (the backend's kernel), native, pallas, interpret or xla "
                                      "(0: xla, a benchmark's other arm); read when a step is traced"),
    "TINYLOOP_LAYER_RINGS": ("1", "0: a model's local layers keep the whole context (a benchmark's other arm)"),
    "TINYLOOP_INT4_ATTENTION": ("auto", "int4 dense attention: auto (the kernel on GPU, jnp elsewhere), pallas, "
                                        "interpret or jnp; read when a config is made"),
    "TINYLOOP_KV_H_MODE": ("0", "1: an h KV mode (fp16-h) when a model names none"),
    "TINYLOOP_KV_INT4": ("0", "1: int4 K/V when a model names no mode (with TINYLOOP_KV_H_MODE=1: int4-h)"),
    "TINYLOOP_JEMALLOC": ("auto", "the jemalloc `tinyloop serve` starts again under: auto (an installed libjemalloc, "
                                  "else the copy ray's wheel ships), a library's path, or 0 (the system's malloc)"),
}


def cell(default: str) -> str:
    """A default as docs/reference.md's table shows it."""
    return f"`{default}`" if default else "(none)"


def get(name: str) -> str:
    """The variable's value, or its default (`VARIABLES`)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of the package's variables: {', '.join(VARIABLES)}")
    return os.environ.get(name, VARIABLES[name][0])


def free_bytes() -> int | None:
    """Memory the backend can still hand out, if it says; else host memory available."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def mapping_headroom() -> int | None:
    """Memory mappings this process may still make under the kernel's `vm.max_map_count`
    (Linux's default 65,530; None where unknown). Each program XLA:CPU compiles maps its kernels'
    code and data, 590-1,125 mappings for a served model's step; past the limit its compiler
    fails ("LLVM compilation error: Cannot allocate memory") and the process dies."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            return limit - sum(1 for _ in f)
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; False where there
    is none). A model's load and XLA:CPU's compiles free hundreds of MiB that the allocator keeps,
    and the pages a server then writes are new mappings that do not reuse them: handed back after
    the warmup, SmolLM2's server peaks at 1.08-1.13 GiB under 16 clients instead of 1.20-1.26
    (docs/benchmarks.md, "Fewer programs, the heap handed back"). Called after compiles
    (`Batcher`)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


# jemalloc's options for a server (where MALLOC_CONF names none): one arena, and free pages handed
# back after a second (dirty) or at once (muzzy). With jemalloc's defaults SmolLM2's server
# peaked at 1.15-1.23 GiB under 16 clients against glibc's 0.96-0.97; with these, 0.90-0.91.
JEMALLOC_CONF = "narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0"


def jemalloc() -> str | None:
    """The jemalloc library to preload (`TINYLOOP_JEMALLOC`), or None: none found, or turned off."""
    choice = get("TINYLOOP_JEMALLOC")
    if choice == "0":
        return None
    if choice != "auto":
        if os.sep in choice and not os.path.isfile(choice):
            raise ValueError(f"TINYLOOP_JEMALLOC={choice!r}: no such file (a jemalloc library's path, auto or 0)")
        return choice
    found = ctypes.util.find_library("jemalloc")  # e.g. Debian's libjemalloc2
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("ray")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "core", "libjemalloc.so")
        if os.path.exists(path):
            return path
    return None


def loaded(library: str) -> bool:
    """Whether a shared library whose file name holds `library` is mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            return any(library in line for line in f)
    except OSError:
        return False


def restart_under_jemalloc(argv: list[str]) -> None:
    """Run `python -m tinyloop_jax.cli *argv` again in this process (exec: the same process id)
    with jemalloc preloaded, where one is found and this process runs without it. XLA's compiles
    spend a fifth of their time in glibc's malloc: SmolLM2's server is warm 34.4-36.3 s after
    launch under it against 37.7-40.4, and peaks at 0.90 GiB under 16 clients against 0.98
    (`JEMALLOC_CONF`; docs/serving.md).
    An allocator is chosen when a process starts, hence the exec; returns where it does not."""
    lib = jemalloc()
    if lib is None or loaded("jemalloc"):
        return
    import sys

    # (TINYLOOP_JEMALLOC 0 in the process started again: where the library fails to load, the
    # loader says so and goes on without it, and that process must not start again in turn)
    env = {**os.environ, "TINYLOOP_JEMALLOC": "0",
           "LD_PRELOAD": " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib]))}
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tinyloop_jax.cli", *argv], env)


def forget_programs() -> None:
    """Drop every program JAX holds compiled in this process (its in-memory caches; the
    persistent cache on disk is kept) and hand the freed heap back. A model's load runs its
    layout changes (stacking layers, tiling packed weights) as dozens of small programs that
    JAX keeps for good: SmolLM2's load compiles 62, which hold ~80 MiB a server never uses
    again. For a process that owns its programs, as `tinyloop serve` does after the load."""
    import jax

    jax.clear_caches()
    gc.collect()
    release_free_memory()
