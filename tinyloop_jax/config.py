"""Model configuration: one frozen, hashable dataclass (it is a static jit argument)."""

from __future__ import annotations

import dataclasses
import os

# Storage modes of the KV cache (SPEC §3): K/V as floats or quantized integers, or the
# "-h" forms that store the block's normalized input h and rebuild K/V from it.
KV_MODES = ("fp16", "fp32", "int8", "int4", "fp16-h", "int8-h", "int4-h")
# How int4 decode attention runs: the Pallas kernel, the kernel interpreted (CPU tests), or jnp.
INT4_ATTENTION = ("pallas", "interpret", "jnp")
# Fields that say how this process runs the model, not what the model is: not saved with
# checkpoints and not part of the model fingerprint.
RUNTIME_FIELDS = ("int4_attention",)


def check_kv_mode(kv_mode: str) -> str:
    if kv_mode in KV_MODES:
        return kv_mode
    raise ValueError(f"unknown kv_mode {kv_mode!r}; valid modes: {', '.join(KV_MODES)}")


def kv_mode_from_env(default: str = "fp16") -> str:
    """The seed's switches, used only when no mode is named: TINYLOOP_KV_H_MODE=1 -> an h
    mode, TINYLOOP_KV_INT4=1 -> int4, both -> int4-h."""
    h = os.environ.get("TINYLOOP_KV_H_MODE") == "1"
    int4 = os.environ.get("TINYLOOP_KV_INT4") == "1"
    if int4:
        return "int4-h" if h else "int4"
    return "fp16-h" if h else default


def int4_attention_from_env() -> str:
    """TINYLOOP_INT4_ATTENTION = auto (default: the kernel on GPU, jnp elsewhere) | pallas |
    interpret | jnp. Read once, when a config is made, never while tracing."""
    import jax

    choice = os.environ.get("TINYLOOP_INT4_ATTENTION", "auto")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    if choice not in INT4_ATTENTION:
        raise ValueError(f"TINYLOOP_INT4_ATTENTION={choice!r}; expected one of auto, {', '.join(INT4_ATTENTION)}")
    return choice


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a looped GPT-2-style model.

    `n_pre_blocks` distinct blocks run once, then one loop block runs `loops` times
    (`default_loops` when a call does not say). With `default_loops=1` the model is a plain
    `(n_pre_blocks + 1)`-layer GPT-2.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_pre_blocks: int = 2
    default_loops: int = 4
    max_seq_len: int = 512
    kv_mode: str | None = None  # None: the environment switches, else fp16
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5
    int4_attention: str | None = None  # None: TINYLOOP_INT4_ATTENTION / the backend (runtime field)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "max_seq_len", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.n_pre_blocks < 0:
            raise ValueError(f"n_pre_blocks must be >= 0, got {self.n_pre_blocks!r}")
        if self.default_loops < 1:
            raise ValueError(f"default_loops must be >= 1, got {self.default_loops!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.kv_mode is None:
            object.__setattr__(self, "kv_mode", kv_mode_from_env())
        check_kv_mode(self.kv_mode)
        if self.kv_mode.startswith("int4") and self.d_model % 2:
            raise ValueError(f"int4 modes pack two values per byte: d_model {self.d_model} must be even")
        if self.int4_attention is None:
            object.__setattr__(self, "int4_attention", int4_attention_from_env())
        if self.int4_attention not in INT4_ATTENTION:
            raise ValueError(f"int4_attention {self.int4_attention!r}; expected one of {', '.join(INT4_ATTENTION)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_cache_layers(self, loops: int) -> int:
        """One cache layer per pre block plus one per loop iteration."""
        return self.n_pre_blocks + loops

    def to_dict(self) -> dict:
        """The model's description (what is saved and fingerprinted; runtime fields left out)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUNTIME_FIELDS}

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
