"""Import a Huginn ("raven", `model_type: huginn_raven`) folder of seal-rg/recurrent-pretraining.

Huginn is a prelude of `n_layers_in_prelude` blocks, a recurrent core of
`n_layers_in_recurrent_block` blocks run `mean_recurrence` times by default, and a coda of
`n_layers_in_coda` blocks: our pre blocks, loop stack and coda, with the concat adapter as the
loop's injection (see `model.recurrence`). Its blocks are Llama-family blocks with normed residual
sums ("SandwichBlock": x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x))), RoPE over adjacent channel
pairs with base `rope_base`, q and k biases (`qk_bias`, added before RoPE; our b_qkv with a zero v
part) and full multi-head attention. Embeddings are scaled by sqrt(n_embd) (the reference always
does); the final norm `ln_f` runs after the recurrence and again after the coda. Tensors
(`nn.Linear` weights [out, in], transposed to ours):

    transformer.wte.weight [V, D]                               -> wte (tied head)
    transformer.{prelude,core_block,coda}.{i}.norm_{1,2,3,4}.weight -> attn_norm, attn_out_norm,
                                                                   mlp_norm, mlp_out_norm
    transformer.*.{i}.attn.Wqkv.weight [3D, D] (q | k | v)      -> w_qkv (head-shaped, `fuse_qkv`)
    transformer.*.{i}.attn.qk_bias [2, 1, H, hd]                -> b_qkv (q, k; v zero)
    transformer.*.{i}.attn.proj.weight [D, D]                   -> w_o
    transformer.*.{i}.mlp.fc.weight [2F, D] (gate | up)         -> w_gate_up [D, 2, F]
    transformer.*.{i}.mlp.proj.weight [D, F]                    -> w_down
    transformer.adapter.weight [D, 2D]                          -> adapter [2D, D]
    transformer.ln_f.weight                                     -> lnf_g
    lm_head.weight       absent when tied (or equal to wte); the head when tie_embeddings is false
    freqs_cis [1, block_size, 1, hd/2, 2]   the reference's RoPE table buffer: checked, not loaded

Config keys the folder leaves out take the reference's constructor defaults; any value this
runtime does not implement is a ValueError naming the key.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..model.config import ModelConfig
from ..model.params import LlamaBlock, Params, fuse_qkv
from .safetensors_io import Tensors

# RavenConfig's constructor defaults for the keys that shape the model (a config.json written
# by hand, like the published one, may omit them: rope_base is absent from it).
DEFAULTS = dict(n_embd=5280, n_heads=55, block_size=4096, vocab_size=65536, tie_embeddings=True,
                intermediate_size=17920, bias=False, norm_eps=1e-6, n_layers_in_recurrent_block=4,
                mean_recurrence=32, n_layers_in_prelude=2, n_layers_in_coda=2, qk_bias=True, rope_base=50_000.0)
# Keys whose value must be the one the reference's minimal modeling file implements.
FIXED = dict(architecture_class_name="RecurrentGPT", block_class_name="SandwichBlock", norm_class_name="RMSNorm_llama",
             mlp_class_name="GatedMLP", nonlin_name="SiLU", injection_type="linear", state_init="like-init",
             bias=False, test_time_noise=0)
ROPE_TABLE_TOLERANCE = 2.0 ** -7  # a table stored in bfloat16 rounds cos/sin to 8 bits


def _get(hf: dict, key: str, *aliases: str):
    for k in (key, *aliases):
        if hf.get(k) is not None:
            return hf[k]
    return DEFAULTS[key]


def _positive(hf: dict, key: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"config.json: {key}={value!r} is not supported (an integer >= {low})")
    return value


def huginn_config(hf: dict, kv_mode: str | None, dtype: str) -> ModelConfig:
    """A huginn_raven config.json -> ModelConfig."""
    for key, want in FIXED.items():
        if key in hf and hf[key] is not None and hf[key] != want:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (only {want!r})")
    D = _positive(hf, "n_embd", _get(hf, "n_embd", "hidden_size"))
    H = _positive(hf, "n_heads", _get(hf, "n_heads", "num_attention_heads"))
    if D % H:
        raise ValueError(f"config.json: n_embd={D} is not divisible by n_heads={H}")
    for key, want in (("num_key_value_heads", H), ("head_dim", D // H)):
        if hf.get(key) is not None and hf[key] != want:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (the reference's attention "
                             f"needs {want})")
    vocab = _positive(hf, "vocab_size", _get(hf, "vocab_size"))
    if hf.get("padded_vocab_size") is not None and hf["padded_vocab_size"] != vocab:
        raise ValueError(f"config.json: padded_vocab_size={hf['padded_vocab_size']!r} differs from vocab_size="
                         f"{vocab} (the reference sets both to vocab_size)")
    tie, qk_bias = _get(hf, "tie_embeddings", "tie_word_embeddings"), _get(hf, "qk_bias")
    for key, v in (("tie_embeddings", tie), ("qk_bias", qk_bias)):
        if not isinstance(v, bool):
            raise ValueError(f"config.json: {key}={v!r} is not supported (true or false)")
    theta, eps = _get(hf, "rope_base"), _get(hf, "norm_eps")
    for key, v in (("rope_base", theta), ("norm_eps", eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"config.json: {key}={v!r} is not supported (a positive number)")
    return ModelConfig(
        vocab_size=vocab, d_model=D, n_heads=H, n_kv_heads=H, head_dim=D // H,
        intermediate_size=_positive(hf, "intermediate_size", _get(hf, "intermediate_size")),
        max_seq_len=_positive(hf, "block_size", _get(hf, "block_size")), kv_mode=kv_mode, block="llama",
        layer_norm_eps=float(eps), rope_theta=float(theta), rope_pairing="adjacent", attention_bias=qk_bias,
        tie_embeddings=tie, dtype=dtype, norm_placement="normed_residual",
        n_pre_blocks=_positive(hf, "n_layers_in_prelude", _get(hf, "n_layers_in_prelude"), low=0),
        loop_blocks=_positive(hf, "n_layers_in_recurrent_block", _get(hf, "n_layers_in_recurrent_block")),
        default_loops=_positive(hf, "mean_recurrence", _get(hf, "mean_recurrence")),
        # the reference applies ln_f before and after the coda; with no coda that is ln_f twice,
        # which our head (one final norm) does not express
        n_post_blocks=_positive(hf, "n_layers_in_coda", _get(hf, "n_layers_in_coda")),
        injection="concat_adapter", embed_scale=math.sqrt(D), norm_before_coda=True)


def rope_table(cfg: ModelConfig) -> np.ndarray:
    """The reference's `freqs_cis` [1, max_seq_len, 1, hd/2, 2] (cos, sin), in float32 as it is
    computed there."""
    hd = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
    freqs = np.outer(np.arange(cfg.max_seq_len, dtype=np.float32), inv.astype(np.float32)).astype(np.float32)
    return np.stack([np.cos(freqs), np.sin(freqs)], axis=-1)[None, :, None]


def load_huginn(path: str, cfg: ModelConfig, tensors: Tensors) -> Params:
    dt, D, F, H, hd = cfg.compute_dtype, cfg.d_model, cfg.intermediate_size, cfg.n_heads, cfg.head_dim

    def block(part: str, i: int) -> LlamaBlock:
        p = f"transformer.{part}.{i}."
        lin = lambda n, o, inn: tensors.take(p + n + ".weight", (o, inn), dt, transpose=True)  # noqa: E731
        norm = lambda k: tensors.take(p + f"norm_{k}.weight", (D,), dt)  # noqa: E731
        qkv = lin("attn.Wqkv", 3 * D, D)  # [D, q | k | v]
        bias = None
        if cfg.attention_bias:
            qk = tensors.take(p + "attn.qk_bias", (2, 1, H, hd), dt).reshape(2, H * hd)
            bias = fuse_qkv(qk[0], qk[1], jnp.zeros((H * hd,), dt), cfg)
        return LlamaBlock(attn_norm=norm(1), w_qkv=fuse_qkv(qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:], cfg),
                          w_o=lin("attn.proj", D, D), mlp_norm=norm(3),
                          w_gate_up=lin("mlp.fc", 2 * F, D).reshape(D, 2, F), w_down=lin("mlp.proj", D, F),
                          b_qkv=bias, attn_out_norm=norm(2), mlp_out_norm=norm(4))

    pre = tuple(block("prelude", i) for i in range(cfg.n_pre_blocks))
    loop = tuple(block("core_block", i) for i in range(cfg.loop_blocks))
    post = tuple(block("coda", i) for i in range(cfg.n_post_blocks))
    wte = tensors.take("transformer.wte.weight", (cfg.vocab_size, D), dt)
    head = None
    if not cfg.tie_embeddings:
        head = tensors.take("lm_head.weight", (cfg.vocab_size, D), dt)
    elif "lm_head.weight" in tensors.where:  # a saved copy of the tied embedding
        if not np.array_equal(np.asarray(tensors.take("lm_head.weight", (cfg.vocab_size, D), dt)), np.asarray(wte)):
            raise ValueError("tensor 'lm_head.weight' differs from 'transformer.wte.weight' but tie_embeddings is true")
    if "freqs_cis" in tensors.where:  # the reference's RoPE buffer: ours computes the same table
        want = rope_table(cfg)
        got = np.asarray(tensors.take("freqs_cis", want.shape, jnp.float32))
        if not np.allclose(got, want, atol=ROPE_TABLE_TOLERANCE, rtol=0):
            raise ValueError(f"tensor 'freqs_cis' is not the RoPE table of rope_base={cfg.rope_theta} "
                             f"(max diff {np.max(np.abs(got - want)):.3g}); config.json and weights disagree")
    params = Params(wte=wte, wpe=None, pre=pre, loop=loop, lnf_g=tensors.take("transformer.ln_f.weight", (D,), dt),
                    lnf_b=None, head=head, post=post,
                    adapter=tensors.take("transformer.adapter.weight", (D, 2 * D), dt, transpose=True))
    tensors.done()
    extra = tensors.unused()
    if extra:
        raise ValueError(f"unexpected tensors in {path} (not a huginn_raven / this config?): {', '.join(extra[:5])}")
    return params
