"""`Model.from_pretrained`: a Hugging Face folder by its `model_type` — "gpt2" (see `hf_gpt2`),
"llama", "ouro", "gemma3_text" or "huginn_raven" (see `hf_huginn`) — as (Params, ModelConfig).

A plain Llama of L layers is n_pre_blocks = L - 1 and one loop block run once. Ouro loops its
whole stack: n_pre_blocks = 0, loop_blocks = num_hidden_layers, default_loops = total_ut_steps,
sandwich norms, the final norm after every pass, and the early-exit gate. Tensor names
(`nn.Linear` weights are [out, in]; ours are [in, out], so each is transposed):

    model.embed_tokens.weight [V, D]                       -> wte
    model.layers.{i}.input_layernorm.weight               -> attn_norm
    model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias} -> w_qkv, b_qkv [.., KV, G + 2, hd] (`fuse_qkv`)
    model.layers.{i}.self_attn.o_proj.weight              -> w_o
    model.layers.{i}.input_layernorm_2.weight             -> attn_out_norm      (ouro)
    model.layers.{i}.post_attention_layernorm.weight      -> mlp_norm
    model.layers.{i}.mlp.{gate,up}_proj.weight            -> w_gate_up [D, 2, F] (gate | up)
    model.layers.{i}.mlp.down_proj.weight                 -> w_down
    model.layers.{i}.post_attention_layernorm_2.weight    -> mlp_out_norm       (ouro)
    model.norm.weight -> lnf_g      lm_head.weight -> head (untied)
    model.early_exit_gate.{weight,bias} -> gate_w, gate_b                                 (ouro)

Gemma 3 (`gemma3_text`): sandwich norms under other names (post_attention_layernorm ->
attn_out_norm, pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm ->
mlp_out_norm), self_attn.{q,k}_norm -> q_norm, k_norm; every RMSNorm scales by (1 + w) in
Hugging Face's weights, so 1 is added at load (ours scale by the weight). Its `layer_types`
give each layer's window (`ModelConfig.layer_windows`), `rope_parameters` (or rope_theta /
rope_local_base_freq) the RoPE bases of global and local layers.

Tensors are read one at a time from the safetensors file(s) straight into the target dtype,
so loading never holds a second copy of the model in host memory. Any config value this
runtime does not implement is a ValueError naming the key, never silently ignored.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import hf_gpt2, hf_huginn
from ..model import qarray
from ..model.config import ModelConfig
from ..model.params import LlamaBlock, Params, fuse_qkv, with_layers
from .safetensors_io import Tensors

MODEL_TYPES = ("gpt2", "llama", "ouro", "gemma3_text", "huginn_raven")


def read_hf_config(path: str) -> dict:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a folder")
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path!r} has no config.json: not a Hugging Face model folder")
    try:
        with open(cfg_file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e


def default_dtype() -> str:
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def _require(hf: dict, key: str, ok, rule: str) -> None:
    """ValueError naming `key` if the config asks for something not implemented."""
    if key in hf and hf[key] is not None and not ok(hf[key]):
        raise ValueError(f"config.json: {key}={hf[key]!r} is not supported ({rule})")


def llama_config(hf: dict, kv_mode: str | None, dtype: str) -> ModelConfig:
    """A Llama or Ouro config.json -> ModelConfig."""
    ouro = hf["model_type"] == "ouro"
    rope = hf.get("rope_parameters") or {}  # transformers >= 5 keeps RoPE's settings here
    _require(hf, "rope_scaling", lambda v: v.get("rope_type", v.get("type")) == "default", "only plain RoPE")
    _require(rope, "rope_type", lambda v: v == "default", "rope_parameters: only plain RoPE")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    _require(hf, "hidden_act", lambda v: v == "silu", "SwiGLU with silu")
    _require(hf, "mlp_bias", lambda v: v is False, "no MLP biases")
    _require(hf, "pretraining_tp", lambda v: v == 1, "pretraining_tp must be 1")
    _require(hf, "use_sliding_window", lambda v: v is False, "per-layer sliding windows are not implemented; "
             "use cache_window")
    _require(hf, "layer_types", lambda v: all(t == "full_attention" for t in v),
             "every layer must be full_attention")
    try:
        D, L, H = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
        vocab, F = int(hf["vocab_size"]), int(hf["intermediate_size"])
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from e
    if L < 1:
        raise ValueError(f"config.json: num_hidden_layers={L}: need at least one layer")
    common = dict(vocab_size=vocab, d_model=D, n_heads=H, n_kv_heads=int(hf.get("num_key_value_heads") or H),
                  head_dim=int(hf.get("head_dim") or D // H), intermediate_size=F,
                  max_seq_len=int(hf.get("max_position_embeddings", 2048)), kv_mode=kv_mode, block="llama",
                  layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
                  attention_bias=bool(hf.get("attention_bias", False)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", not ouro)), dtype=dtype)
    if not ouro:
        return ModelConfig(n_pre_blocks=L - 1, loop_blocks=1, default_loops=1, **common)
    step, thr = hf.get("early_exit_step"), hf.get("early_exit_threshold")
    return ModelConfig(n_pre_blocks=0, loop_blocks=L, default_loops=int(hf.get("total_ut_steps", 4)),
                       norm_placement="sandwich", pass_norm=True, early_exit_gate=True,
                       early_exit_step=None if step is None else int(step),
                       early_exit_threshold=None if thr is None else float(thr), **common)


def gemma3_config(hf: dict, kv_mode: str | None, dtype: str) -> ModelConfig:
    """A Gemma 3 text config.json (`gemma3_text`) -> ModelConfig."""
    import math

    rope = hf.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    for name, part in (("full_attention", full), ("sliding_attention", local)):
        _require(part, "rope_type", lambda v: v == "default", f"rope_parameters.{name}: only plain RoPE")
    _require(hf, "rope_scaling", lambda v: v.get("rope_type", v.get("type")) == "default", "only plain RoPE")
    _require(hf, "hidden_activation", lambda v: v == "gelu_pytorch_tanh", "tanh-GELU gating")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        _require(hf, key, lambda v: False, "no soft-capping")
    _require(hf, "use_bidirectional_attention", lambda v: v is False, "causal attention only")
    _require(hf, "attention_bias", lambda v: v is False, "no attention biases")
    try:
        D, L, H = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
        vocab, F, hd = int(hf["vocab_size"]), int(hf["intermediate_size"]), int(hf.get("head_dim") or 256)
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from e
    _require(hf, "query_pre_attn_scalar", lambda v: int(v) == hd, f"queries scaled by head_dim ({hd}) ** -0.5")
    window = int(hf.get("sliding_window") or 0)
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                      for i in range(L)]
    if len(types) != L or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json: layer_types={types!r}: one of full_attention / sliding_attention per layer")
    return ModelConfig(vocab_size=vocab, d_model=D, n_heads=H, n_kv_heads=int(hf.get("num_key_value_heads") or H),
                       head_dim=hd, intermediate_size=F, max_seq_len=int(hf.get("max_position_embeddings", 32768)),
                       kv_mode=kv_mode, block="llama", layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                       rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1000000.0))),
                       rope_local_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
                       layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", True)), dtype=dtype,
                       n_pre_blocks=L - 1, loop_blocks=1, default_loops=1, norm_placement="sandwich", qk_norm=True,
                       mlp_act="gelu_tanh", embed_scale=math.sqrt(D))


# the sandwich's and q / k norms' names: (attn_out_norm, mlp_norm, mlp_out_norm, q_norm, k_norm)
_NORMS = {"ouro": ("input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2", None, None),
          "gemma3": ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
                     "self_attn.q_norm", "self_attn.k_norm"),
          "llama": (None, "post_attention_layernorm", None, None, None)}


def load_llama(path: str, cfg: ModelConfig, tensors: Tensors) -> Params:
    dt, D, F = cfg.compute_dtype, cfg.d_model, cfg.intermediate_size
    qd, kd = cfg.q_dim, cfg.kv_dim
    family = "gemma3" if cfg.qk_norm else "ouro" if cfg.norm_placement == "sandwich" else "llama"
    out_name, mlp_name, mlp_out_name, q_name, k_name = _NORMS[family]
    one = 1.0 if family == "gemma3" else 0.0  # Gemma's norms scale by (1 + w)

    def norm(name: str, k: int):
        w = tensors.take(name + ".weight", (k,), jnp.float32)
        return (w + one).astype(dt)

    def layer(i: int) -> LlamaBlock:
        p = f"model.layers.{i}."
        lin = lambda n, o, inn: tensors.take(p + n + ".weight", (o, inn), dt, transpose=True)  # noqa: E731
        vec = lambda n, k: tensors.take(p + n, (k,), dt)  # noqa: E731
        opt = lambda n, k: None if n is None else norm(p + n, k)  # noqa: E731
        qkv = qarray.apply(lambda q, k, v: fuse_qkv(q, k, v, cfg), lin("self_attn.q_proj", qd, D),
                           lin("self_attn.k_proj", kd, D), lin("self_attn.v_proj", kd, D))
        bias = None
        if cfg.attention_bias:
            bias = fuse_qkv(*(vec(f"self_attn.{n}_proj.bias", k) for n, k in (("q", qd), ("k", kd), ("v", kd))), cfg)
        return LlamaBlock(attn_norm=opt("input_layernorm", D), w_qkv=qkv, w_o=lin("self_attn.o_proj", D, qd),
                          mlp_norm=opt(mlp_name, D),
                          w_gate_up=qarray.apply(lambda g, u: jnp.stack([g, u], axis=-2), lin("mlp.gate_proj", F, D),
                                                 lin("mlp.up_proj", F, D)),
                          w_down=lin("mlp.down_proj", D, F), b_qkv=bias, attn_out_norm=opt(out_name, D),
                          mlp_out_norm=opt(mlp_out_name, D), q_norm=opt(q_name, cfg.head_dim),
                          k_norm=opt(k_name, cfg.head_dim))

    blocks = [layer(i) for i in range(cfg.n_pre_blocks + cfg.loop_blocks)]
    wte = tensors.take("model.embed_tokens.weight", (cfg.vocab_size, D), dt)
    head = None
    if not cfg.tie_embeddings:
        head = tensors.take("lm_head.weight", (cfg.vocab_size, D), dt)
    elif "lm_head.weight" in tensors.where:  # a saved copy of the tied embedding
        same = np.array_equal(np.asarray(qarray.dense(tensors.take("lm_head.weight", (cfg.vocab_size, D), dt))),
                              np.asarray(qarray.dense(wte)))
        if not same:
            raise ValueError("tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                             "tie_word_embeddings is true")
    gate_w = gate_b = None
    if cfg.early_exit_gate:
        gate_w = tensors.take("model.early_exit_gate.weight", (1, D), dt)[0]
        gate_b = tensors.take("model.early_exit_gate.bias", (1,), jnp.float32)[0]
    params = Params(wte=wte, wpe=None, pre=tuple(blocks[:cfg.n_pre_blocks]), loop=tuple(blocks[cfg.n_pre_blocks:]),
                    lnf_g=norm("model.norm", D), lnf_b=None, head=head, gate_w=gate_w, gate_b=gate_b)
    tensors.done()
    extra = tensors.unused()
    if extra:
        raise ValueError(f"unexpected tensors in {path} (not a {cfg.block} / this config?): {', '.join(extra[:5])}")
    return with_layers(params, cfg)


def load(path: str, kv_mode: str | None = None, dtype: str | None = None) -> tuple[Params, ModelConfig]:
    """A Hugging Face folder -> (Params, ModelConfig), dispatched on config.json's model_type."""
    path = os.fspath(path)
    hf = read_hf_config(path)
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} in {path}/config.json; supported: {', '.join(MODEL_TYPES)}")
    dtype = default_dtype() if dtype is None else dtype
    if model_type == "gpt2":
        params, cfg = hf_gpt2.load(path, kv_mode)
        return params, cfg.replace(dtype=dtype)
    if model_type == "huginn_raven":
        cfg = hf_huginn.huginn_config(hf, kv_mode, dtype)
        return hf_huginn.load_huginn(path, cfg, Tensors(path)), cfg
    cfg = gemma3_config(hf, kv_mode, dtype) if model_type == "gemma3_text" else llama_config(hf, kv_mode, dtype)
    return load_llama(path, cfg, Tensors(path)), cfg
