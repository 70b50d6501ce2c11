import functools
import gc
import os
import tempfile

# Tracing and lowering build many small Python objects, and CPython's default thresholds (700,
# 10, 10) ran a full collection of the whole heap 19 times in three test files (5.9 s of 118 s);
# collecting less often leaves 2 (1.9 s). Subprocesses that import this file get it too.
gc.set_threshold(50_000, 20, 20)

# The suite's programs are tiny and run briefly, so compiling dominates: compile them without
# LLVM's optimizations and with XLA:CPU's classic (faster to build) fusion emitters — 4-6x faster
# compiles of the same optimized HLO, so the same buffers, aliasing and results — and each
# program's code in one LLVM module, not split for parallel code generation: the xdist workers
# already keep both cores busy, and splitting costs a sixth of the compile time, a quarter
# when the core is shared (scripts/bench_suite_flags.py). Set before JAX starts its backend;
# subprocesses inherit it, and add nothing twice: the flags are part of a persistent cache key,
# so a subprocess with them repeated loaded none of the programs the tests had compiled.
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                   "--xla_cpu_parallel_codegen_split_count=1")
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in SUITE_XLA_FLAGS if f not in _flags])

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax import settings  # noqa: E402
from tinyloop_jax.model import transformer as tf  # noqa: E402

# The suite's workers allocate with jemalloc (`settings.jemalloc`: an installed libjemalloc, else
# the copy ray's wheel ships, ray being a test dependency): XLA's compiles spent a fifth of their
# time in glibc's malloc (a perf profile of a speculative program's compile), and three
# compile-heavy test files took 95-109 s under jemalloc against 119-122 s (four runs each,
# alternating). Set here, before pytest-xdist starts its workers, which inherit it, as do the
# subprocesses the tests start (the mesh checks, `tinyloop serve`); the process reading this keeps
# the allocator it started with. Results do not depend on the allocator.
JEMALLOC = settings.jemalloc()
if JEMALLOC and JEMALLOC not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), JEMALLOC]))


def no_suite_allocator(env=None) -> dict:
    """A subprocess environment (default: this process's) without the suite's jemalloc."""
    env = dict(os.environ if env is None else env)
    kept = [p for p in env.get("LD_PRELOAD", "").split() if p != JEMALLOC]
    env.pop("LD_PRELOAD", None)
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    return env


# A persistent compilation cache for the suite, outside the repo (the system's temp folder,
# one per jax version): programs compiled once are loaded, not recompiled, after the per-module
# clear below, in later runs, and in the subprocesses the tests start (they inherit the variable).
JAX_CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                  os.path.join(tempfile.gettempdir(), f"tinyloop-jax-tests-{jax.__version__}"))
jax.config.update("jax_compilation_cache_dir", JAX_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

TINY = dict(vocab_size=128, d_model=32, n_heads=4, n_pre_blocks=2, default_loops=3, max_seq_len=128)


def tiny_config(**kw) -> tl.ModelConfig:
    return tl.ModelConfig(**{**TINY, **kw})


@functools.lru_cache(maxsize=None)
def tiny_model(kv_mode: str, seed: int = 0) -> tl.Model:
    """The suite's shared tiny random model in one KV mode (the same weights in every mode).
    Models are immutable, so tests share one instance per mode instead of building their own."""
    return tl.Model.random(tiny_config(kv_mode=kv_mode), seed=seed)


# An Ouro-layout model: no pre blocks, a stack of 2 Llama-family blocks looped 3 times, sandwich
# norms, the final norm after every pass, the exit gate, an untied head, 4 heads over 2 KV heads.
OURO = dict(vocab_size=128, d_model=32, n_heads=4, n_kv_heads=2, n_pre_blocks=0, loop_blocks=2, default_loops=3,
            max_seq_len=128, block="llama", norm_placement="sandwich", pass_norm=True, early_exit_gate=True,
            tie_embeddings=False, intermediate_size=48, rope_theta=10000.0)


@functools.lru_cache(maxsize=None)
def ouro_model(kv_mode: str, seed: int = 0) -> tl.Model:
    return tl.Model.random(tl.ModelConfig(**OURO, kv_mode=kv_mode), seed=seed)


# A random model of Huginn's layout: injection (its concat adapter), a coda, adjacent RoPE,
# normed residuals, drawn initial states.
HUGINN = dict(vocab_size=128, d_model=32, n_heads=4, block="llama", intermediate_size=48, n_pre_blocks=1,
              loop_blocks=2, n_post_blocks=1, default_loops=3, max_seq_len=128, norm_placement="normed_residual",
              injection="concat_adapter", embed_scale=4.0, norm_before_coda=True, rope_pairing="adjacent",
              attention_bias=True, kv_mode="fp32")


@functools.lru_cache(maxsize=None)
def huginn_model(seed: int = 0, **kw) -> tl.Model:
    """A random Huginn-layout model whose recurrence is contractive, as a trained Huginn's
    converging one is: its loop blocks' output norms scaled by 1/4. At full gain a random
    recurrence amplifies a float sum's order (a paged against a dense attention) to 1e-3 of a
    logit within tens of positions, 0.9x of the equivalence bound on an EPYC, 1.006x on a Xeon
    (tests/test_paged.py); calmed, 0.06-0.43x over model seeds 0-3."""
    import dataclasses
    from tinyloop_jax.model.init import random_params
    cfg = tl.ModelConfig(**{**HUGINN, **kw})
    p = random_params(cfg, seed)
    calm = tuple(dataclasses.replace(b, attn_out_norm=b.attn_out_norm / 4, mlp_out_norm=b.mlp_out_norm / 4)
                 for b in p.loop)
    return tl.Model(dataclasses.replace(p, loop=calm), cfg)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (model, tokenizer): fetched once per machine, loaded once
    per session (tests/test_gguf.py, tests/test_chat.py), as served: its weights kept packed,
    float32 compute, fp32 KV. (Its dequantized float32 load gives the same logits,
    tests/test_qarray.py; packed, its pre blocks run in a layer loop whose programs compile
    2.6x faster and decode 3.6x faster under the suite's XLA flags: docs/testing.md.)"""
    return tl.Model.from_pretrained("smollm2", kv_mode="fp32", dtype="float32"), tl.load_tokenizer("smollm2")


class _Models(dict):
    def __missing__(self, mode):
        return tiny_model(mode)


@pytest.fixture(scope="session")
def models():
    """mode -> the shared tiny model in that KV mode (built on first use)."""
    return _Models()


@pytest.fixture(scope="session")
def mode_models(models):
    return models


@functools.partial(jax.jit, static_argnames=("cfg", "loops", "window"))
def forward_seq(params, cfg: tl.ModelConfig, tokens, loops: int, window: int = 0, seed=None):
    """The tests' cache-free reference (`transformer.forward_seq`) as one program, its weights an
    argument: run eagerly it compiled a program a primitive (Gemma 3 270M's check: 342 of them,
    15.4 s against 6.1), and closed over, the weights became the program's constants."""
    return tf.forward_seq(params, cfg, tokens, loops, window, seed)


def prompt_of(n: int, seed: int = 0, vocab: int = TINY["vocab_size"]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def check_position_reset_fails(model) -> None:
    """Seed 000's pair reproduces recompute, and the same path with the suffix's positions reset
    to 0 must not (the negative control of the position rule)."""
    from tinyloop_jax.api import functional as F
    w = model.weights
    p, s = prompt_of(24, seed=1), prompt_of(5, seed=2)
    saved = F.save_prefix_cache(p, w)
    full = model.next_token_logits(np.concatenate([p, s]))
    np.testing.assert_allclose(F.generate_with_prefix(saved, len(p), s, w), full, atol=1e-3, rtol=1e-2)
    assert not np.allclose(F.generate_with_prefix(saved, 0, s, w), full, atol=1e-3, rtol=1e-2)


def cache_layers(cache) -> list[dict]:
    """Every cache layer's arrays of an unbatched segment, pre layers then passes."""
    return [cache.layer(i) for i in range(cache.n_layers)]


_rss_after_clear = [0]  # this worker's resident bytes after its last drop (0: none yet)


def _rss_and_maps() -> tuple[int, int, int]:
    """(resident bytes, memory maps, the kernel's memory-map limit) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
        return rss, maps, int(f.read())


def _held_heavily() -> bool:
    """The process holds many compiled programs: over a quarter of the kernel's memory-map limit
    (each executable maps its code), or 4 GiB more resident than after the last drop (what a
    drop cannot free — the real model's weights, a session's fixtures — is not counted twice:
    measured from a fixed 4 GiB, a worker holding SmolLM2 dropped its programs after every later
    module)."""
    try:
        rss, maps, limit = _rss_and_maps()
    except (OSError, ValueError):
        return True  # cannot tell: drop them
    return rss - _rss_after_clear[0] > 4 << 30 or maps > limit // 4


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop compiled programs after a test module once the process holds many. Holding every
    program of the suite in one process once crashed XLA's compiler (a segfault in
    backend_compile); dropping them after every module made later modules trace and load again
    the programs they share (the suite's tiny models): 18% of those modules' time. A program
    dropped and needed again is loaded from the persistent cache above, not recompiled."""
    yield
    if _held_heavily():
        jax.clear_caches()
        try:
            _rss_after_clear[0] = _rss_and_maps()[0]
        except (OSError, ValueError):
            pass
