import numpy as np
import pytest

import tinyloop_jax as tl

TINY = dict(vocab_size=128, d_model=32, n_heads=4, n_pre_blocks=2, default_loops=3, max_seq_len=128)


def tiny_config(**kw) -> tl.ModelConfig:
    return tl.ModelConfig(**{**TINY, **kw})


@pytest.fixture(scope="session")
def models():
    """One tiny random model per KV mode (same weights)."""
    return {mode: tl.Model.random(tiny_config(kv_mode=mode), seed=0) for mode in ("fp32", "fp16")}


def prompt_of(n: int, seed: int = 0, vocab: int = TINY["vocab_size"]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop compiled programs after each test module. The suite compiles a few hundred XLA:CPU
    programs (every mode x depth x window); holding all of them in one process crashed XLA's
    compiler (a segfault in backend_compile, reproducible at the same test)."""
    yield
    import jax
    jax.clear_caches()
