"""GGUF files (llama.cpp, ollama) as a Hugging Face model: `Model.from_pretrained("x.gguf")`.

A GGUF file holds the hyperparameters as metadata (`llama.block_count`, ...), the tokenizer
(`tokenizer.ggml.*`, see `gguf_vocab`) and the tensors under llama.cpp's names. This module reads
it (`gguf_reader`) and presents it to the Hugging Face import the way a folder looks: an HF-style
config dict (`hf_config`) and a tensor source with HF names (`GGUFTensors`, the same interface as
`safetensors_io.Tensors`), so the one Llama path (`hf_import`) or GPT-2 path (`hf_gpt2`) builds
the model. `general.architecture` "llama":

    token_embd.weight            -> model.embed_tokens.weight
    blk.{i}.attn_norm.weight     -> model.layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.weight  -> model.layers.{i}.self_attn.{q,k,v}_proj.weight   (q, k un-permuted)
    blk.{i}.attn_output.weight   -> model.layers.{i}.self_attn.o_proj.weight
    blk.{i}.ffn_norm.weight      -> model.layers.{i}.post_attention_layernorm.weight
    blk.{i}.ffn_{gate,up,down}.weight -> model.layers.{i}.mlp.{gate,up,down}_proj.weight
    output_norm.weight -> model.norm.weight      output.weight -> lm_head.weight (absent: tied)

"gpt2" (llama.cpp's converter transposes GPT-2's [in, out] Conv1D matrices to [out, in] rows;
they are transposed back; `output.weight` is written even when tied: equal to the embedding, tied):

    token_embd.weight -> wte.weight   position_embd.weight -> wpe.weight   output.weight -> lm_head.weight
    output_norm.{weight,bias} -> ln_f.*       blk.{i}.attn_norm.* -> h.{i}.ln_1.*
    blk.{i}.attn_qkv.* -> h.{i}.attn.c_attn.*   blk.{i}.attn_output.* -> h.{i}.attn.c_proj.*
    blk.{i}.ffn_norm.* -> h.{i}.ln_2.*   blk.{i}.ffn_up.* -> h.{i}.mlp.c_fc.*   blk.{i}.ffn_down.* -> h.{i}.mlp.c_proj.*

GGUF lists a tensor's dims fastest first ([in, out]); its rows are Hugging Face's [out, in]
rows. Tensors are dequantized one at a time to float32 numpy (the `gguf` package's
`quants.dequantize`, checked block by block against ggml's reference in tests/test_gguf.py: F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), then cast to the model's dtype.

llama.cpp's converter permutes the rows of q_proj and k_proj so that its RoPE kernel rotates
adjacent pairs (x0, x1), (x2, x3) ... where Hugging Face rotates halves (x_j, x_{j + hd/2}):
per head, HF row (half a, index j) is stored at GGUF row 2 j + a. `unpermute` undoes it.
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np

from ..model import qarray
from ..model import qpack

from .gguf_reader import MAGIC, GGUFFile

ARCHITECTURES = ("llama", "gpt2", "gemma3")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

# per architecture: whole-model names, per-block names, the HF prefix of block i
_NAMES = {
    "llama": ({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"},
              {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
              "model.layers.{}."),
    "gpt2": ({"token_embd.weight": "wte.weight", "position_embd.weight": "wpe.weight",
              "output.weight": "lm_head.weight", "output_norm.weight": "ln_f.weight", "output_norm.bias": "ln_f.bias"},
             {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
             "h.{}."),
    "gemma3": ({"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"},
               {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
               "model.layers.{}."),
}
# Gemma 3's sliding-window layers: llama.cpp's fixed pattern (every sixth layer global) and the
# local layers' RoPE base, neither of which the file states
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0


def hf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> Hugging Face's ('blk.3.attn_q.weight' ->
    'model.layers.3.self_attn.q_proj.weight'); a name with no HF twin is returned as 'gguf:<name>'."""
    top, layer, prefix = _NAMES[arch]
    if name in top:
        return top[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
        return f"{prefix.format(parts[1])}{layer[parts[2]]}.{parts[3]}"
    return "gguf:" + name


def find_file(path) -> str | None:
    """The GGUF file `path` names: a file starting with the GGUF magic, or a folder without a
    config.json holding exactly one `*.gguf` (ValueError if it holds several). None otherwise."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return path if f.read(4) == MAGIC or path.endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path!r} holds several GGUF files ({', '.join(found)}); pass one of them")
    return os.path.join(path, found[0]) if found else None


def open_file(path: str) -> GGUFFile:
    """A parsed GGUF file (tensors memory-mapped, read when used); ValueError naming the file for
    anything that is not a complete GGUF file."""
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default=None):
    """Metadata value `key` (int, float, bool, str or list), `default` if absent."""
    return reader.fields.get(key, default)


def architecture(reader: GGUFFile) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{reader.path}: general.architecture {arch!r} is not supported; supported: "
                         f"{', '.join(ARCHITECTURES)}")
    return arch


def hf_config(reader: GGUFFile) -> dict:
    """The metadata of a GGUF file as a Hugging Face config dict: a LlamaConfig's (for
    `hf_import.llama_config`) or a GPT2Config's (for `hf_gpt2.gpt2_config`)."""
    arch, path = architecture(reader), reader.path

    def need(key: str, default=None, kind=int):
        v = field(reader, f"{arch}.{key}", default)
        if v is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        if isinstance(v, (list, str)):  # e.g. per-layer head counts
            raise ValueError(f"{path}: GGUF metadata {arch}.{key}={v!r} is not supported (one {kind.__name__})")
        return kind(v)

    names = set(reader.tensors)
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = int(reader.tensors["token_embd.weight"].shape[0])
    if need("vocab_size", vocab) != vocab:
        raise ValueError(f"{path}: {arch}.vocab_size={need('vocab_size')} but token_embd.weight has {vocab} rows")
    if arch == "gpt2":
        return {"model_type": "gpt2", "n_embd": need("embedding_length"), "n_layer": need("block_count"),
                "n_head": need("attention.head_count"), "n_positions": need("context_length"),
                "n_inner": need("feed_forward_length"), "vocab_size": vocab,
                "layer_norm_epsilon": decimal(need("attention.layer_norm_epsilon", kind=float)),
                "tie_word_embeddings": "output.weight" not in names}
    D, H = need("embedding_length"), need("attention.head_count")
    head_dim = need("attention.key_length", D // H)
    if need("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: {arch}.attention.value_length differs from key_length ({head_dim}): not supported")
    rope_dim = need("rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count={rope_dim} (partial RoPE) is not supported; "
                         f"head_dim is {head_dim}")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported (only plain RoPE)")
    if need("expert_count", 0) > 0:
        raise ValueError(f"{path}: {arch}.expert_count={need('expert_count')}: mixture-of-experts models are not "
                         "supported")
    if "rope_freqs.weight" in names:  # llama 3.1's frequency scaling, as per-dimension factors
        raise ValueError(f"{path}: tensor 'rope_freqs.weight' (scaled RoPE) is not supported (only plain RoPE)")
    if arch == "gemma3":  # a Gemma3TextConfig's fields (transformers reads the file the same way)
        L = need("block_count")
        pattern = need("attention.sliding_window_pattern", GEMMA3_PATTERN)
        return {"model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": D,
                "num_attention_heads": H, "num_hidden_layers": L, "intermediate_size": need("feed_forward_length"),
                "num_key_value_heads": need("attention.head_count_kv", H), "head_dim": head_dim,
                "query_pre_attn_scalar": head_dim, "max_position_embeddings": need("context_length", 32768),
                "rms_norm_eps": decimal(need("attention.layer_norm_rms_epsilon", kind=float)),
                "rope_theta": decimal(need("rope.freq_base", 1000000.0, float)),
                "rope_local_base_freq": GEMMA3_LOCAL_THETA, "sliding_window": need("attention.sliding_window", 512),
                "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(L)],
                "tie_word_embeddings": "output.weight" not in names, "vocab_size": vocab}
    return {"model_type": "llama", "hidden_act": "silu", "hidden_size": D, "num_attention_heads": H,
            "num_hidden_layers": need("block_count"), "intermediate_size": need("feed_forward_length"),
            "num_key_value_heads": need("attention.head_count_kv", H), "head_dim": head_dim,
            "max_position_embeddings": need("context_length", 2048),
            "rms_norm_eps": decimal(need("attention.layer_norm_rms_epsilon", kind=float)),
            "rope_theta": decimal(need("rope.freq_base", 10000.0, float)),
            "attention_bias": "blk.0.attn_q.bias" in names, "tie_word_embeddings": "output.weight" not in names,
            "vocab_size": vocab}


def decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-5, not 9.999999747e-06)."""
    return float(str(np.float32(x)))


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: [n_heads * hd, ...] with per-head rows (j, half) -> (half, j).

    >>> unpermute(np.array([0, 2, 1, 3]), 1).tolist()   # one head, hd = 4: HF rows 0..3 stored as 0, 2, 1, 3
    [0, 1, 2, 3]
    """
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(reader: GGUFFile, name: str) -> np.ndarray:
    """Tensor `name` (GGUF's name) -> float32 numpy in row-major shape (GGUF's dims reversed)."""
    from gguf import GGMLQuantizationType, quants

    info = reader.tensors[name]
    kind = reader.type_name(info)
    if kind not in TENSOR_TYPES:
        raise ValueError(f"tensor {name!r} has type {kind}; supported: {', '.join(TENSOR_TYPES)}")
    return np.asarray(quants.dequantize(reader.data(info), GGMLQuantizationType(info.ggml_type)),
                      np.float32).reshape(info.shape)


class GGUFTensors:
    """A GGUF file's tensors under Hugging Face names, read and dequantized one at a time (the
    interface of `safetensors_io.Tensors`: `where`, `shape`, `read`, `take`, `unused`, `done`).
    Llama: q/k rows back in Hugging Face's order (`heads` = {"q_proj": H, "k_proj": KV});
    GPT-2: the block matrices back to Conv1D's [in, out]. With `keep_packed`, quantized matrices
    (every type in `qarray.FORMATS`: Q8_0, Q4_x, Q5_x, Q4_K, Q5_K, Q6_K) are read as
    `qarray.QuantArray`s of their bytes, not dequantized (all of a llama file's; a GPT-2 file's
    block matrices, embedding and head: its position table stays float, indexed by position
    rather than multiplied)."""

    def __init__(self, reader: GGUFFile, heads: dict | None = None, progress: bool | None = None,
                 keep_packed: bool = False):
        self.reader, self.path, self.used = reader, reader.path, set()
        self.keep_packed = keep_packed
        self.arch = architecture(reader)
        self.where = {hf_name(name, self.arch): name for name in reader.tensors}
        self._heads = heads or {}
        self.progress = os.path.getsize(self.path) > 256 * 2**20 if progress is None else progress

    def _transposed(self, name: str) -> bool:
        return self.arch == "gpt2" and name.startswith("h.") and name.endswith(".weight") and len(self._raw(name)) == 2

    def _raw(self, name: str) -> tuple:
        return self.reader.tensors[self.where[name]].shape

    def shape(self, name: str) -> tuple:
        return self._raw(name)[::-1] if self._transposed(name) else self._raw(name)

    def read(self, name: str, dtype):
        """Tensor `name` dequantized (or kept packed), in Hugging Face's order and shape, cast;
        not marked used."""
        info = self.reader.tensors[self.where[name]]
        proj = name.rsplit(".", 2)[-2]
        fmt = self.reader.type_name(info).lower()
        if self.keep_packed and fmt in qarray.FORMATS and len(info.shape) == 2 and name != "wpe.weight":
            raw = self.reader.data(info)  # [rows, bytes]: GGUF's rows are HF's rows (llama's Linear)
            raw = unpermute(raw, self._heads[proj]) if proj in self._heads else raw
            w = qpack.from_blocks(raw, fmt, info.shape[1], transposed=True)  # logical [out, in]
            return w.T if self._transposed(name) else w  # GPT-2's Conv1D: [in, out]
        a = dequantize(self.reader, self.where[name])
        if proj in self._heads:
            a = unpermute(a, self._heads[proj])
        if self.arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp stores 1 + w: Hugging Face's w
            a = a - np.float32(1.0)
        return jnp.asarray(a.T if self._transposed(name) else a, dtype)

    def take(self, name: str, shape: tuple, dtype, transpose: bool = False):
        """Tensor `name`, checked against `shape` (Hugging Face's), cast, transposed if asked."""
        if name not in self.where:
            raise ValueError(f"tensor {name!r} is missing from {self.path}")
        if self.shape(name) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {self.shape(name)}; the metadata implies {tuple(shape)}")
        a = self.read(name, dtype)
        self.used.add(name)
        n, total = len(self.used), len(self.where)
        if self.progress and (n == total or n % max(1, total // 20) == 0):
            print(f"\rloading {self.path}: {n}/{total} tensors", end="", file=sys.stderr, flush=True)
        return a.T if transpose else a

    def unused(self, ignore: tuple = ()) -> list[str]:
        return sorted(k for k in self.where if k not in self.used and not k.endswith(tuple(ignore)))

    def done(self) -> None:
        if self.progress:
            print(file=sys.stderr)


def load(path, kv_mode: str | None = None, dtype: str | None = None, keep_packed: bool = False):
    """A GGUF file (or a folder holding one) -> (Params, ModelConfig) through the Hugging Face
    import of its architecture (`hf_import`'s Llama path, `hf_gpt2`). `keep_packed`: quantized
    matrices stay packed (`qarray`; see `GGUFTensors`; fused parts in different types as a
    `qarray.Fused`)."""
    from . import hf_gpt2, hf_import

    file = find_file(path)
    if file is None:
        raise ValueError(f"{os.fspath(path)!r} is not a GGUF file nor a folder holding one")
    reader = open_file(file)
    hf = hf_config(reader)
    for name, info in reader.tensors.items():  # before reading any: fail fast
        if reader.type_name(info) not in TENSOR_TYPES:
            raise ValueError(f"{file}: tensor {name!r} has type {reader.type_name(info)}; supported: "
                             f"{', '.join(TENSOR_TYPES)}")
    dtype = hf_import.default_dtype() if dtype is None else dtype
    if hf["model_type"] == "gpt2":
        params, cfg = hf_gpt2.load_gpt2(file, hf_gpt2.gpt2_config(hf, kv_mode, file),
                                        GGUFTensors(reader, keep_packed=keep_packed))
        return params, cfg.replace(dtype=dtype)
    if hf["model_type"] == "gemma3_text":  # q and k as Hugging Face orders them (rotate-half RoPE in llama.cpp too)
        cfg = hf_import.gemma3_config(hf, kv_mode, dtype)
        return hf_import.load_llama(file, cfg, GGUFTensors(reader, keep_packed=keep_packed)), cfg
    cfg = hf_import.llama_config(hf, kv_mode, dtype)
    heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
    return hf_import.load_llama(file, cfg, GGUFTensors(reader, heads, keep_packed=keep_packed)), cfg
