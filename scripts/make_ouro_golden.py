"""Golden outputs of Ouro's own modeling code on a tiny random model, for tests/test_ouro.py.

    python scripts/make_ouro_golden.py PATH/TO/modeling_ouro.py [--out tests/data/ouro-tiny]

The reference (`modeling_ouro.py`, e.g. from the public repository Eagle4398/ouro-nixpkgs) needs
transformers 4.54.x and torch. The script makes its own virtual environment for them
(`--venv`, default ~/.cache/tinyloop-ouro-ref) and re-runs itself there; nothing is installed
into the project's environment. The reference file is copied into a temporary package next to
a small config class of our own (`OuroConfig`, which the released checkpoints ship separately)
and is never committed.

Written to --out: the tiny model in Ouro's Hugging Face layout (config.json +
model.safetensors) and golden.npz: for several prompts, the logits at every position (default
exit: the last pass), each pass's output states and gate values, the exit distribution, the
logits with exit_at_step = each pass and with several exit thresholds, and greedy
continuations by full recompute (no cache).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _side_venv  # noqa: E402

TRANSFORMERS = "transformers==4.54.1"
TORCH = "torch==2.13.0"

# Tiny, but every feature on: grouped-query attention (4 heads, 2 KV heads), 3 layers looped
# 3 times, sandwich norms, the per-pass final norm and the exit gate, an untied head.
CONFIG = dict(model_type="ouro", architectures=["OuroForCausalLM"], vocab_size=128, hidden_size=64,
              intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              hidden_act="silu", max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
              rope_scaling=None, attention_dropout=0.0, total_ut_steps=3, early_exit_step=None,
              early_exit_threshold=None, tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
              layer_types=["full_attention"] * 3, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
PROMPT_LENS = (5, 17, 40)
THRESHOLDS = (0.2, 0.5, 0.8)
GREEDY_TOKENS = 10

CONFIG_SOURCE = '''
from transformers.configuration_utils import PretrainedConfig


class OuroConfig(PretrainedConfig):
    """The fields modeling_ouro.py reads (written for the golden files; not Ouro's own file)."""

    model_type = "ouro"

    def __init__(self, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=None, hidden_act="silu",
                 max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                 attention_dropout=0.0, total_ut_steps=4, early_exit_step=None, early_exit_threshold=None,
                 use_sliding_window=False, sliding_window=None, layer_types=None, use_cache=True,
                 initializer_range=0.02, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act, self.max_position_embeddings = hidden_act, max_position_embeddings
        self.rms_norm_eps, self.rope_theta, self.rope_scaling = rms_norm_eps, rope_theta, rope_scaling
        self.attention_dropout, self.total_ut_steps = attention_dropout, total_ut_steps
        self.early_exit_step, self.early_exit_threshold = early_exit_step, early_exit_threshold
        self.use_sliding_window, self.sliding_window = use_sliding_window, sliding_window
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.use_cache, self.initializer_range = use_cache, initializer_range
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''


def ensure_env(venv: str) -> None:
    """Re-run this script in a venv with the reference's dependencies (made on first use)."""
    def ready():
        import torch  # noqa: F401
        import transformers
        return transformers.__version__.startswith("4.54.")
    _side_venv.reexec(venv, [TORCH, TRANSFORMERS, "safetensors", "numpy"], ready)


def randomize(model, seed: int) -> None:
    """Weights large enough that every term moves the logits (the default 0.02 init gives a
    near-uniform output): matrices ~ N(0, 2/sqrt(fan_in)), norm weights ~ 1 + N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p.shape[1] ** 0.5))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:  # the gate's bias
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        model.lm_head.weight.mul_(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="path to Ouro's modeling_ouro.py")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "ouro-tiny"))
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tinyloop-ouro-ref"), type=os.path.abspath)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not os.path.isfile(args.reference):
        sys.exit(f"{args.reference}: no such file")
    ensure_env(args.venv)

    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file

    pkg_root = tempfile.mkdtemp()
    pkg = os.path.join(pkg_root, "ouro_ref")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    with open(os.path.join(pkg, "configuration_ouro.py"), "w") as f:
        f.write(CONFIG_SOURCE)
    shutil.copy(args.reference, os.path.join(pkg, "modeling_ouro.py"))
    sys.path.insert(0, pkg_root)
    from ouro_ref.configuration_ouro import OuroConfig
    from ouro_ref.modeling_ouro import OuroForCausalLM

    torch.manual_seed(args.seed)
    fields = {k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = OuroConfig(**fields, attn_implementation="eager")
    model = OuroForCausalLM(config).eval()
    randomize(model, args.seed)

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(out, "model.safetensors"))

    rng = np.random.default_rng(args.seed)
    golden = {"transformers_version": np.array(transformers.__version__), "torch_version": np.array(torch.__version__)}
    with torch.no_grad():
        for i, n in enumerate(PROMPT_LENS):
            ids = rng.integers(3, CONFIG["vocab_size"], n)
            x = torch.tensor(ids[None], dtype=torch.long)
            golden[f"prompt_{i}"] = ids.astype(np.int32)
            golden[f"logits_{i}"] = model(x, use_cache=False).logits[0].numpy()
            _, states, gates = model.model(input_ids=x, use_cache=False)
            golden[f"states_{i}"] = torch.stack(states)[:, 0].numpy()  # [passes, T, D]
            gate = torch.sigmoid(torch.stack(gates)[:, 0, :, 0])  # [passes, T]
            golden[f"gates_{i}"] = gate.numpy()
            pdf, rem = [], torch.ones_like(gate[0])
            for t in range(len(gates)):  # the reference's formula, on the reference's gates
                pdf.append(gate[t] * rem if t < len(gates) - 1 else rem)
                rem = rem * (1 - gate[t])
            golden[f"exit_pdf_{i}"] = torch.stack(pdf).numpy()
            for s in range(CONFIG["total_ut_steps"]):
                golden[f"logits_step{s}_{i}"] = model(x, use_cache=False, exit_at_step=s).logits[0].numpy()
            for t, thr in enumerate(THRESHOLDS):
                golden[f"logits_thr{t}_{i}"] = model(x, use_cache=False, exit_threshold=thr).logits[0].numpy()
            seq = list(ids)
            for _ in range(GREEDY_TOKENS):  # greedy by full recompute (no cache)
                logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                seq.append(int(torch.argmax(logits)))
            golden[f"greedy_{i}"] = np.array(seq[n:], np.int32)
    golden["thresholds"] = np.array(THRESHOLDS, np.float32)
    np.savez(os.path.join(out, "golden.npz"), **golden)
    shutil.rmtree(pkg_root)
    print(f"wrote {out}: config.json, model.safetensors, golden.npz ({len(PROMPT_LENS)} prompts)")


if __name__ == "__main__":
    main()
