"""Import a Hugging Face GPT-2 folder (`config.json` + `model.safetensors`) as TinyLoop params.

A k-layer GPT-2 is a TinyLoop model with n_pre_blocks = k - 1 and the last layer as the loop
block, run once (default_loops = 1). Hugging Face's `Conv1D` stores weights as [in, out], like
ours, so every tensor maps one to one (c_attn's q | k | v columns viewed [D, 3, H, hd]):

    wte.weight [V, D] -> wte        h.{i}.ln_1.{weight,bias}     -> ln1_g, ln1_b
    wpe.weight [S, D] -> wpe        h.{i}.attn.c_attn.{weight,bias} [D, 3D] -> w_qkv, b_qkv (head-shaped)
    ln_f.{weight,bias} -> lnf_*     h.{i}.attn.c_proj.{weight,bias} [D, D]  -> w_o, b_o
                                    h.{i}.ln_2.{weight,bias}     -> ln2_g, ln2_b
                                    h.{i}.mlp.c_fc.{weight,bias} [D, F]     -> w_fc, b_fc
                                    h.{i}.mlp.c_proj.{weight,bias} [F, D]   -> w_proj, b_proj

Read tensor by tensor with `safetensors` (no torch; one file or shards). Anything that does not
fit is a ValueError naming it.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..model.config import ModelConfig
from ..model import qarray
from ..model.params import BlockParams, Params, from_flat_layout
from .safetensors_io import Tensors

_BLOCK = {  # our field -> (HF name inside h.{i}., shape as a function of (D, F))
    "ln1_g": ("ln_1.weight", lambda D, F: (D,)), "ln1_b": ("ln_1.bias", lambda D, F: (D,)),
    "w_qkv": ("attn.c_attn.weight", lambda D, F: (D, 3 * D)), "b_qkv": ("attn.c_attn.bias", lambda D, F: (3 * D,)),
    "w_o": ("attn.c_proj.weight", lambda D, F: (D, D)), "b_o": ("attn.c_proj.bias", lambda D, F: (D,)),
    "ln2_g": ("ln_2.weight", lambda D, F: (D,)), "ln2_b": ("ln_2.bias", lambda D, F: (D,)),
    "w_fc": ("mlp.c_fc.weight", lambda D, F: (D, F)), "b_fc": ("mlp.c_fc.bias", lambda D, F: (F,)),
    "w_proj": ("mlp.c_proj.weight", lambda D, F: (F, D)), "b_proj": ("mlp.c_proj.bias", lambda D, F: (D,)),
}
_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers of older checkpoints: not weights
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")


def read_config(path: str, kv_mode: str | None = None) -> ModelConfig:
    """config.json -> ModelConfig (n_pre_blocks = n_layer - 1, default_loops = 1)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path!r} has no config.json: not a Hugging Face GPT-2 folder")
    try:
        with open(cfg_file) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    return gpt2_config(hf, kv_mode, cfg_file)


def gpt2_config(hf: dict, kv_mode: str | None = None, source: str = "config.json") -> ModelConfig:
    """A GPT2Config dict (a folder's config.json, or a GGUF file's metadata as one) -> ModelConfig."""
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"model_type {hf['model_type']!r} in {source}; only 'gpt2' can be imported")
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise ValueError(f"activation_function {act!r}; supported: {', '.join(_GELU_TANH)} (GPT-2's tanh GELU)")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
        if hf.get(flag, want) != want:
            raise ValueError(f"{flag}={hf[flag]!r} is not supported (GPT-2 uses {want})")
    try:
        D, n_layer = int(hf["n_embd"]), int(hf["n_layer"])
        n_head, n_pos, vocab = int(hf["n_head"]), int(hf["n_positions"]), int(hf["vocab_size"])
    except KeyError as e:
        raise ValueError(f"{source} lacks {e.args[0]!r}") from e
    if n_layer < 1:
        raise ValueError(f"n_layer={n_layer}: need at least one layer")
    inner = hf.get("n_inner") or 4 * D
    if inner % D:
        raise ValueError(f"n_inner={inner} is not a multiple of n_embd={D}")
    return ModelConfig(vocab_size=vocab, d_model=D, n_heads=n_head, n_pre_blocks=n_layer - 1, default_loops=1,
                       max_seq_len=n_pos, kv_mode=kv_mode, mlp_ratio=inner // D,
                       layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
                       tie_embeddings=bool(hf.get("tie_word_embeddings", True)))


def load(path: str, kv_mode: str | None = None) -> tuple[Params, ModelConfig]:
    """A Hugging Face GPT-2 folder -> (float32 Params, ModelConfig), read tensor by tensor."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a folder")
    # GPT2LMHeadModel saves "transformer."-prefixed names; the bare GPT2Model does not.
    return load_gpt2(path, read_config(path, kv_mode), Tensors(path, strip="transformer."))


def host(a):
    """A float tensor as a numpy array; a packed one (`qarray.QuantArray`) as it is."""
    return a if qarray.is_quant(a) else np.asarray(a)


def load_gpt2(path: str, cfg: ModelConfig, tensors) -> tuple[Params, ModelConfig]:
    """GPT-2 weights under Hugging Face's names from `tensors` (a folder's `Tensors`, a GGUF file's
    `GGUFTensors`) -> (Params, cfg): float32, or packed where a GGUF's matrices are kept packed.
    An untied config reads `lm_head.weight` as the head, unless it is a copy of `wte` (then the
    model is tied)."""
    D, F = cfg.d_model, cfg.intermediate_size
    # floats as numpy; a GGUF's packed matrices (`qarray.QuantArray`) as they are
    take = lambda name, shape: host(tensors.take(name, shape, np.float32))  # noqa: E731
    same = lambda a, b: np.array_equal(np.asarray(qarray.dense(a)), np.asarray(qarray.dense(b)))  # noqa: E731

    blocks = [BlockParams(**{f: qarray.apply(lambda a, f=f: from_flat_layout(f, a, cfg), take(f"h.{i}.{hf}",
                                                                                          shape(D, F)))
                             for f, (hf, shape) in _BLOCK.items()}) for i in range(cfg.n_pre_blocks + 1)]
    wte, head = take("wte.weight", (cfg.vocab_size, D)), None
    if not cfg.tie_embeddings:
        head = take("lm_head.weight", wte.shape)
        if same(head, wte):  # a copy of the embedding: tied after all
            head = None
    elif "lm_head.weight" in tensors.where and not same(take("lm_head.weight", wte.shape), wte):
        raise ValueError("tensor 'lm_head.weight' differs from 'wte.weight' but tie_word_embeddings is true "
                         "(an untied head needs it false)")
    params = Params(wte=wte, wpe=take("wpe.weight", (cfg.max_seq_len, D)), pre=tuple(blocks[:-1]),
                    loop=(blocks[-1],), lnf_g=take("ln_f.weight", (D,)), lnf_b=take("ln_f.bias", (D,)), head=head)
    tensors.done()
    extra = tensors.unused(ignore=_BUFFERS)
    if extra:
        raise ValueError(f"unexpected tensors in {path} (not GPT-2?): {', '.join(extra[:5])}")
    return params, cfg.replace(tie_embeddings=head is None)
