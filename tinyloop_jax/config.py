"""Model configuration: one frozen, hashable dataclass (it is a static jit argument)."""

from __future__ import annotations

import dataclasses

# Storage modes of the KV cache (SPEC §3). Modes listed in KV_MODES_PLANNED are named by the
# spec but not built yet; asking for one is a clear error rather than a silent fallback.
KV_MODES = ("fp16", "fp32")
KV_MODES_PLANNED = ("int8", "int4", "fp16-h", "int8-h", "int4-h")


def check_kv_mode(kv_mode: str) -> str:
    if kv_mode in KV_MODES:
        return kv_mode
    if kv_mode in KV_MODES_PLANNED:
        raise ValueError(f"kv_mode {kv_mode!r} is not implemented yet; available: {', '.join(KV_MODES)}")
    raise ValueError(f"unknown kv_mode {kv_mode!r}; valid modes: {', '.join(KV_MODES + KV_MODES_PLANNED)}")


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
    kv_mode: str = "fp16"
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5

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
        check_kv_mode(self.kv_mode)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def n_cache_layers(self, loops: int) -> int:
        """One cache layer per pre block plus one per loop iteration."""
        return self.n_pre_blocks + loops

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
