"""Golden files for Llama parity: a small random `LlamaForCausalLM` built by Hugging Face
`transformers` (grouped-query attention, untied head), its logits and greedy generations, so
the test suite checks parity without torch.

    pip install -e ".[hf]"          # transformers + torch (here: pip install torch==2.13.0, a CPU wheel)
    python scripts/make_llama_golden.py

Writes tests/data/llama-tiny/{config.json, model.safetensors, golden.npz}. Seeded.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LENGTHS = (1, 9, 40)
GEN_PROMPTS = (6, 21)
NEW_TOKENS = 12


def build(out: str, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, attention_bias=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # larger than the 0.02 default, norm weights off 1: every term moves the logits
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[1] ** 0.5))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True)
    return model


def main():
    import torch
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "llama-tiny"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = build(args.out)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    golden = {"transformers_version": np.asarray(transformers.__version__)}
    with torch.no_grad():
        for n in PROMPT_LENGTHS:
            p = rng.integers(0, vocab, n).tolist()
            golden[f"prompt_{n}"] = np.asarray(p, np.int32)
            golden[f"logits_{n}"] = model(torch.tensor([p])).logits[0].float().numpy()
        for n in GEN_PROMPTS:
            p = rng.integers(0, vocab, n).tolist()
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            golden[f"gen_prompt_{n}"] = np.asarray(p, np.int32)
            golden[f"gen_{n}"] = out[0].numpy().astype(np.int32)
    np.savez_compressed(os.path.join(args.out, "golden.npz"), **golden)
    for f in sorted(os.listdir(args.out)):
        print(f"{f}: {os.path.getsize(os.path.join(args.out, f)):,} bytes")


if __name__ == "__main__":
    main()
