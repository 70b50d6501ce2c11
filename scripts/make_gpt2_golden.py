"""Golden files for GPT-2 parity: a small random GPT-2 built by Hugging Face `transformers`, and
its logits and greedy generations, so the test suite checks parity without torch.

    pip install -e ".[hf]"          # transformers + torch (here: pip install torch==2.13.0, a CPU wheel)
    python scripts/make_gpt2_golden.py

Writes tests/data/gpt2-tiny/{config.json, model.safetensors, golden.npz}. The model is seeded,
so rerunning gives the same files (up to torch's kernels).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENGTHS = (1, 7, 33, 100)
GEN_PROMPTS = (5, 16, 64)  # prompt lengths for the greedy generations
NEW_TOKENS = 24


def build(out: str, n_layer=3, n_embd=64, n_head=4, vocab=1000, n_positions=128, seed=0):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=n_positions,
                     initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # HF initialises biases to 0 and LayerNorms to 1: randomise them so all terms count
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name or name.startswith("transformer.ln_f"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def hf_greedy(model, tokens, new: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0].tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "gpt2-tiny"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = build(args.out)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    golden = {}
    for n in PROMPT_LENGTHS:
        p = rng.integers(0, vocab, n).tolist()
        golden[f"prompt_{n}"] = np.asarray(p, np.int32)
        golden[f"logits_{n}"] = hf_logits(model, p)  # [n, V]: every position
    for n in GEN_PROMPTS:
        p = rng.integers(0, vocab, n).tolist()
        golden[f"gen_prompt_{n}"] = np.asarray(p, np.int32)
        golden[f"gen_{n}"] = np.asarray(hf_greedy(model, p, NEW_TOKENS), np.int32)
    import transformers

    golden["transformers_version"] = np.asarray(transformers.__version__)
    np.savez_compressed(os.path.join(args.out, "golden.npz"), **golden)
    for f in sorted(os.listdir(args.out)):
        print(f"{f}: {os.path.getsize(os.path.join(args.out, f)):,} bytes")


if __name__ == "__main__":
    main()
