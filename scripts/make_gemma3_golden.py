"""Golden outputs of Hugging Face `transformers`' Gemma 3 for tests/test_gemma3.py.

    python scripts/make_gemma3_golden.py            # both parts
    python scripts/make_gemma3_golden.py --tiny     # only the tiny random model

The reference needs transformers >= 5.23 (its Gemma 3 and its GGUF reader) and torch; the script
makes its own virtual environment for them (`--venv`, default ~/.cache/tinyloop-gemma-ref) and
re-runs itself there; nothing is installed into the project's environment.

1. A tiny random `Gemma3ForCausalLM` (`gemma3_text`: grouped-query attention with one KV head,
   q / k norms, sandwich norms, tanh-GELU, embeddings scaled by sqrt(d), 6 layers of which the
   sixth is global and the others slide over 8 positions with their own RoPE base), written to
   tests/data/gemma3-tiny/{config.json, model.safetensors, golden.npz}: logits at every
   position of prompts of 5, 17 and 40 tokens (the windows shorter than the last two), and
   greedy continuations by full recompute.
2. The real Gemma 3 270M Q4_K_M file (`tl.model_path("gemma3-270m")`, fetched once) loaded by
   transformers from the GGUF (its weights dequantized to float32): token ids of a dozen strings
   by its GGUF tokenizer, logits of three prompts at every position at 1,024 vocabulary entries
   each (the 64 largest and 960 fixed random ones: the whole rows would be 1 MiB each), and a
   greedy continuation. Written to tests/data/gemma3-270m-golden.npz.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _side_venv  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRANSFORMERS = "transformers>=5.23"
TORCH = "torch==2.13.0"
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, sliding_window=8, rope_theta=1000000.0, rope_local_base_freq=10000.0,
            query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
            max_position_embeddings=256, tie_word_embeddings=True, final_logit_softcapping=None,
            attn_logit_softcapping=None, attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0)
PROMPT_LENS = (5, 17, 40)
GEN_PROMPTS = (6, 21)
NEW_TOKENS = 12
STRINGS = ["The capital of France is", "Hello, world!", "  two leading spaces", "tabs\tand\nnewlines\n\n",
           "naïve café, déjà vu", "日本語のテキスト", "emoji 🤖🚀 and symbols ∑∫√", "x = f(y) + 3.14159",
           "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)", "<start_of_turn>user\nhi<end_of_turn>",
           "Supercalifragilisticexpialidocious", "1234567890 000 42", ""]
PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, in a small village,"]
GREEDY = ("The capital of France is", 16)
KEEP_TOP, KEEP_RANDOM = 64, 960


def ensure_env(venv: str) -> None:
    """Re-run this script in a venv with the reference's dependencies (made on first use)."""
    def ready():
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
        import torch  # noqa: F401
        import transformers
        return int(transformers.__version__.split(".")[0]) >= 5
    _side_venv.reexec(venv, [TORCH, TRANSFORMERS, "gguf", "accelerate", "safetensors", "numpy"], ready)


def tiny(out: str, seed: int = 0) -> None:
    import numpy as np
    import torch
    import transformers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    os.makedirs(out, exist_ok=True)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the default init: every term moves the logits
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
            else:  # Gemma's norms scale by (1 + w): w near 0
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True)
    os.remove(os.path.join(out, "generation_config.json"))  # nothing the tests read
    cfg = json.load(open(os.path.join(out, "config.json")))
    print("layer types:", cfg.get("layer_types"))
    rng = np.random.default_rng(seed)
    golden = {"transformers_version": np.asarray(transformers.__version__)}
    with torch.no_grad():
        for n in PROMPT_LENS:
            p = rng.integers(0, TINY["vocab_size"], n).tolist()
            golden[f"prompt_{n}"] = np.asarray(p, np.int32)
            golden[f"logits_{n}"] = model(torch.tensor([p]), use_cache=False).logits[0].float().numpy()
        for n in GEN_PROMPTS:
            p = rng.integers(0, TINY["vocab_size"], n).tolist()
            ids = list(p)
            for _ in range(NEW_TOKENS):  # full recompute each step: no cache in the reference
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
            golden[f"gen_prompt_{n}"] = np.asarray(p, np.int32)
            golden[f"gen_{n}"] = np.asarray(ids, np.int32)
    np.savez_compressed(os.path.join(out, "golden.npz"), **golden)
    for f in sorted(os.listdir(out)):
        print(f"{out}/{f}: {os.path.getsize(os.path.join(out, f)):,} bytes")


def real(out: str, path: str) -> None:
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    golden = {"transformers_version": np.asarray(transformers.__version__), "strings": np.asarray(STRINGS)}
    for i, s in enumerate(STRINGS):
        golden[f"ids_{i}"] = np.asarray(tok(s)["input_ids"], np.int32)
    V = model.config.vocab_size
    fixed = np.random.default_rng(0).choice(V, KEEP_RANDOM, replace=False)
    with torch.no_grad():
        for i, s in enumerate(PROMPTS):
            ids = tok(s)["input_ids"]
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()  # [T, V]
            keep = np.stack([np.concatenate([np.argsort(-row)[:KEEP_TOP], fixed]) for row in logits])
            golden[f"prompt_{i}"] = np.asarray(ids, np.int32)
            golden[f"index_{i}"] = keep.astype(np.int32)
            golden[f"logits_{i}"] = np.take_along_axis(logits, keep, axis=1)
        text, n = GREEDY
        ids = tok(text)["input_ids"]
        out_ids = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0].tolist()
        golden["greedy_prompt"] = np.asarray(ids, np.int32)
        golden["greedy"] = np.asarray(out_ids, np.int32)
        print(repr(tok.decode(out_ids[len(ids):])))
    np.savez_compressed(out, **golden)
    print(f"{out}: {os.path.getsize(out):,} bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="only the tiny random model")
    ap.add_argument("--gguf", help="the Gemma 3 270M file (default: fetched by the project, outside this venv)")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tinyloop-gemma-ref"), type=os.path.abspath)
    args = ap.parse_args()
    if not args.tiny and args.gguf is None:  # fetched by the project's own code, before leaving its env
        args.gguf = subprocess.check_output([sys.executable, "-c", "import tinyloop_jax as tl; "
                                             "print(tl.model_path('gemma3-270m'))"], cwd=ROOT, text=True).strip()
        sys.argv += ["--gguf", args.gguf]
    ensure_env(args.venv)
    tiny(os.path.join(ROOT, "tests", "data", "gemma3-tiny"))
    if not args.tiny:
        real(os.path.join(ROOT, "tests", "data", "gemma3-270m-golden.npz"), args.gguf)


if __name__ == "__main__":
    main()
