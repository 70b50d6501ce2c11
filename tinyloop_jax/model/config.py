"""Model configuration: one frozen, hashable dataclass (it is a static jit argument)."""

from __future__ import annotations

import dataclasses
import math

from .kv_modes import KVMode, check_kv_mode, kv_mode as parse_kv_mode
from .. import settings

# How int4 decode attention runs: the Pallas kernel, the kernel interpreted (CPU tests), or jnp.
INT4_ATTENTION = ("pallas", "interpret", "jnp")
# Fields that say how this process runs the model, not what the model is: not saved with
# checkpoints and not part of the model fingerprint.
RUNTIME_FIELDS = ("int4_attention", "mesh")
BLOCKS = ("gpt2", "llama")  # GPT-2 (LayerNorm, biases, GELU, learned positions) | Llama (RMSNorm, RoPE, SwiGLU, GQA)
# sandwich (Ouro): x += n2(attn(n1 x)); x += n4(mlp(n3 x)) | normed_residual (Huginn): the sums normed,
# x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))
NORM_PLACEMENTS = ("pre", "sandwich", "normed_residual")
INJECTIONS = ("none", "concat_adapter")  # how a pass takes the pre blocks' output (see `recurrence`)
ROPE_PAIRINGS = ("half", "adjacent")  # RoPE rotates channel i with i + hd/2 (Llama) or 2i with 2i + 1 (Huginn)
MLP_ACTS = ("silu", "gelu_tanh")  # a llama block's gate activation: SwiGLU (Llama) | tanh-GELU (Gemma)
DTYPES = ("float32", "bfloat16")


def kv_mode_from_env(default: str = "fp16") -> str:
    """The seed's switches, used only when no mode is named: TINYLOOP_KV_H_MODE=1 -> an h
    mode, TINYLOOP_KV_INT4=1 -> int4, both -> int4-h."""
    h = settings.get("TINYLOOP_KV_H_MODE") == "1"
    int4 = settings.get("TINYLOOP_KV_INT4") == "1"
    if int4:
        return "int4-h" if h else "int4"
    return "fp16-h" if h else default


def int4_attention_from_env() -> str:
    """TINYLOOP_INT4_ATTENTION = auto (default: the kernel on GPU, jnp elsewhere) | pallas |
    interpret | jnp. Read once, when a config is made, never while tracing."""
    import jax

    choice = settings.get("TINYLOOP_INT4_ATTENTION")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "jnp"
    if choice not in INT4_ATTENTION:
        raise ValueError(f"TINYLOOP_INT4_ATTENTION={choice!r}; expected one of auto, {', '.join(INT4_ATTENTION)}")
    return choice


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a looped transformer.

    `n_pre_blocks` distinct blocks run once, then a stack of `loop_blocks` = k distinct blocks
    runs `loops` times (`default_loops` when a call does not say), then `n_post_blocks` distinct
    blocks (a coda) once. Cache layer of pass t, loop block j: n_pre_blocks + t * k + j; the
    coda's come last. With k = 1 and `default_loops=1` the model is a plain
    `(n_pre_blocks + 1)`-layer transformer; Ouro is n_pre_blocks = 0, k = num_hidden_layers.

    Block family (`block`): "gpt2" (LayerNorm with bias, fused biased QKV, tanh-GELU MLP, learned
    positions `wpe`) or "llama" (RMSNorm, RoPE with `rope_theta` and rotate-half pairing, SwiGLU
    MLP of `intermediate_size`, grouped-query attention with `n_kv_heads`, no biases unless
    `attention_bias`). `norm_placement` "sandwich" adds a norm on each sub-block's output;
    `pass_norm` applies the final norm after every pass and feeds the normed stream on (Ouro).
    `early_exit_gate`: the model has Ouro's exit gate (Linear D -> 1 on each pass's output);
    `early_exit_step` / `early_exit_threshold` are the calls' defaults. `dtype`: weights and
    compute (norms, softmax and the KV codecs stay float32).

    Huginn's recurrence (`injection="concat_adapter"`, see `recurrence`): every pass starts from
    `adapter(concat(state, e))`, e the pre blocks' output, the state starting from a truncated
    normal of std sqrt(2 / (5 d_model)) * `state_init_scale` * `embed_scale` drawn per position
    from the request's seed (0: the zero state); `embed_scale` multiplies the token embeddings;
    `norm_before_coda` applies the final norm to the loop's output before the coda (and again
    before the head); `rope_pairing="adjacent"` rotates channel pairs (2i, 2i + 1).

    Gemma 3 (llama blocks): `mlp_act="gelu_tanh"` gates the MLP by tanh-GELU; `qk_norm` applies
    an RMSNorm to each head's q and k before RoPE; `embed_scale` (sqrt(d_model)) scales the token
    embeddings; `layer_windows`, one entry per distinct block (pre blocks, loop blocks, coda
    blocks, in that order), is each block's own sliding window (0: it sees everything), and
    `rope_local_theta` the RoPE base of the blocks with a window (0: `rope_theta`). A call's
    `cache_window` applies on top: a block sees the smaller of the two windows.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_pre_blocks: int = 2
    default_loops: int = 4
    max_seq_len: int = 512
    kv_mode: str | None = None  # None: the environment switches, else fp16
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5  # the eps of every norm (LayerNorm or RMSNorm)
    int4_attention: str | None = None  # None: TINYLOOP_INT4_ATTENTION / the backend (runtime field)
    block: str = "gpt2"
    norm_placement: str = "pre"
    pass_norm: bool = False
    loop_blocks: int = 1
    n_post_blocks: int = 0
    tie_embeddings: bool = True
    dtype: str = "float32"
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    head_dim: int | None = None  # None: d_model // n_heads
    intermediate_size: int | None = None  # None: d_model * mlp_ratio
    rope_theta: float = 10000.0
    attention_bias: bool = False  # llama blocks: biases on q, k, v
    early_exit_gate: bool = False
    early_exit_step: int | None = None
    early_exit_threshold: float | None = None
    mesh: object = None  # a ('data', 'model') jax.sharding.Mesh, or None: one device (runtime field)
    injection: str = "none"
    state_init_scale: float = 1.0
    embed_scale: float = 1.0
    norm_before_coda: bool = False
    rope_pairing: str = "half"
    mlp_act: str = "silu"
    qk_norm: bool = False
    layer_windows: tuple = ()
    rope_local_theta: float = 0.0
    kv_share: str = "full"  # what later tokens read of a finished token's passes (`kv_share`)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "max_seq_len", "mlp_ratio"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.n_pre_blocks < 0:
            raise ValueError(f"n_pre_blocks must be >= 0, got {self.n_pre_blocks!r}")
        if self.default_loops < 1:
            raise ValueError(f"default_loops must be >= 1, got {self.default_loops!r}")
        for name, allowed in (("block", BLOCKS), ("norm_placement", NORM_PLACEMENTS), ("dtype", DTYPES),
                              ("injection", INJECTIONS), ("rope_pairing", ROPE_PAIRINGS), ("mlp_act", MLP_ACTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; supported: {', '.join(allowed)}")
        if self.loop_blocks < 1:
            raise ValueError(f"loop_blocks must be >= 1, got {self.loop_blocks!r}")
        if self.n_post_blocks < 0:
            raise ValueError(f"n_post_blocks must be >= 0, got {self.n_post_blocks!r}")
        if self.n_post_blocks and (self.pass_norm or self.early_exit_gate):
            raise ValueError(f"n_post_blocks={self.n_post_blocks} with pass_norm / early_exit_gate is not supported "
                             "(a per-pass norm or exit before a coda has no defined meaning)")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads!r} must divide n_heads={self.n_heads}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", self.d_model * self.mlp_ratio)
        if self.block == "gpt2":
            for name, want in (("n_kv_heads", self.n_heads), ("head_dim", self.d_model // self.n_heads),
                               ("norm_placement", "pre"), ("attention_bias", False),
                               ("rope_pairing", "half")):
                if getattr(self, name) != want:
                    raise ValueError(f"{name}={getattr(self, name)!r} is not supported with block='gpt2' "
                                     f"(needs {want!r})")
        self._check_recurrence()
        self._check_layers()
        if self.block == "llama" and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE rotates pairs, it must be even")
        if self.early_exit_step is not None and self.early_exit_step < 0:
            raise ValueError(f"early_exit_step must be >= 0, got {self.early_exit_step!r}")
        if self.early_exit_threshold is not None and not 0.0 <= self.early_exit_threshold <= 1.0:
            raise ValueError(f"early_exit_threshold must be in [0, 1], got {self.early_exit_threshold!r}")
        if self.kv_mode is None:
            object.__setattr__(self, "kv_mode", kv_mode_from_env())
        check_kv_mode(self.kv_mode)
        from .kv_share import parse as parse_share

        object.__setattr__(self, "kv_share", str(parse_share(self.kv_share)))  # ("last" is "ring:1")
        if parse_share(self.kv_share).kind == "first":
            import warnings

            warnings.warn("kv_share='first' reads every finished token at its first pass: only for models trained "
                          "for it (others lose their quality)", stacklevel=3)
        if self.storage.format.packed and (self.d_model % 2 or self.head_dim % 2):
            raise ValueError(f"int4 modes pack two values per byte: d_model {self.d_model} and head_dim "
                             f"{self.head_dim} must be even")
        if self.int4_attention is None:
            object.__setattr__(self, "int4_attention", int4_attention_from_env())
        if self.int4_attention not in INT4_ATTENTION:
            raise ValueError(f"int4_attention {self.int4_attention!r}; expected one of {', '.join(INT4_ATTENTION)}")

    def _check_layers(self) -> None:
        """The per-block settings: ValueError naming the field."""
        object.__setattr__(self, "layer_windows", tuple(self.layer_windows))  # a list from JSON
        n = self.n_pre_blocks + self.loop_blocks + self.n_post_blocks
        if self.layer_windows and (len(self.layer_windows) != n or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in self.layer_windows)):
            raise ValueError(f"layer_windows={self.layer_windows!r}: one window >= 0 per distinct block ({n})")
        if self.block == "gpt2" and (self.mlp_act != "silu" or self.qk_norm or self.layer_windows):
            raise ValueError("mlp_act, qk_norm and layer_windows are llama-block settings (block='gpt2')")
        if self.rope_local_theta < 0:
            raise ValueError(f"rope_local_theta must be >= 0, got {self.rope_local_theta!r}")

    def block_window(self, i: int) -> int:
        """Distinct block i's own sliding window (pre blocks, loop blocks, coda; 0: none)."""
        return self.layer_windows[i] if self.layer_windows else 0

    def block_theta(self, i: int) -> float:
        """Distinct block i's RoPE base."""
        return self.rope_local_theta if self.block_window(i) and self.rope_local_theta else self.rope_theta

    def _check_recurrence(self) -> None:
        """ValueError naming the field for a Huginn-recurrence setting this runtime does not run."""
        for name, low in (("state_init_scale", 0.0), ("embed_scale", math.ulp(0.0))):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low:
                raise ValueError(f"{name} must be a finite number {'>= 0' if low == 0 else '> 0'}, got {v!r}")
        if self.injection == "none":
            if self.state_init_scale != 1.0:
                raise ValueError(f"state_init_scale={self.state_init_scale!r} needs injection='concat_adapter'")
        elif self.pass_norm or self.early_exit_gate:
            raise ValueError(f"injection={self.injection!r} with pass_norm / early_exit_gate is not supported")
        if self.norm_before_coda and not self.n_post_blocks:
            raise ValueError("norm_before_coda=True needs coda blocks (n_post_blocks >= 1)")

    @property
    def out_norms(self) -> bool:
        """Blocks carry a norm on each sub-block's output (sandwich) or on each residual sum."""
        return self.norm_placement in ("sandwich", "normed_residual")

    def n_cache_layers(self, loops: int) -> int:
        """One cache layer per pre block, per loop block per pass, and per coda block."""
        return self.n_pre_blocks + loops * self.loop_blocks + self.n_post_blocks

    def check_positions(self, n_positions: int, what: str) -> None:
        """RuntimeError if `what` feeds tokens at positions >= max_seq_len of a model with learned
        positions (GPT-2 blocks: a table of max_seq_len rows, which the programs clamp into for
        padding; a real token there would silently read the last row). RoPE models have no table."""
        if self.block == "gpt2" and n_positions > self.max_seq_len:
            raise RuntimeError(f"{what} needs positions up to {n_positions - 1}, past the learned positions of this "
                               f"GPT-2 model (max_seq_len={self.max_seq_len})")

    @property
    def share(self):
        """`kv_share` parsed (`kv_share.Share`)."""
        from .kv_share import parse

        return parse(self.kv_share)

    def require_full_share(self, what: str) -> None:
        """ValueError where `what` does not serve a compact `kv_share` yet."""
        if self.kv_share != "full":
            raise ValueError(f"kv_share={self.kv_share!r} is not served by {what} yet (Model.generate and its prefix "
                             f"calls are; docs/engine-plan.md, issue 62)")

    @property
    def storage(self) -> KVMode:
        """`kv_mode` parsed: the format and codec every module uses."""
        return parse_kv_mode(self.kv_mode)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        """The model's description (what is saved and fingerprinted; runtime fields left out).
        Architecture fields at their defaults are left out too, so a GPT-2-family model saved
        before they existed describes (and fingerprints) itself exactly as it did."""
        derived = dict(ARCH_FIELDS, n_kv_heads=self.n_heads, head_dim=self.d_model // self.n_heads,
                       intermediate_size=self.d_model * self.mlp_ratio)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in fields.items() if k not in RUNTIME_FIELDS and not (k in derived and v == derived[k])}

    @property
    def compute_dtype(self):
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """A saved description -> config (missing keys at their defaults). An unknown key is a
        ValueError naming it: a description from a newer version may describe another model."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {', '.join(map(repr, unknown))}: saved by a newer "
                             "version of tinyloop-jax? Loading it could run a different model")
        return cls(**d)


# Fields added with the Llama family, and their defaults: omitted from `to_dict` when they say
# nothing (their value is what the default resolves to).
ARCH_FIELDS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
               if f.name in ("block", "norm_placement", "pass_norm", "loop_blocks", "n_post_blocks", "tie_embeddings",
                             "dtype", "n_kv_heads", "head_dim", "intermediate_size", "rope_theta", "attention_bias",
                             "early_exit_gate", "early_exit_step", "early_exit_threshold", "injection",
                             "state_init_scale", "embed_scale", "norm_before_coda", "rope_pairing", "mlp_act",
                             "qk_norm", "layer_windows", "rope_local_theta", "kv_share")}
