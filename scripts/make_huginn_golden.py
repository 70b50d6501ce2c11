"""Golden outputs of Huginn's own modeling code on tiny random models, for tests/test_huginn.py.

    python scripts/make_huginn_golden.py PATH/TO/recpre [--out tests/data]

PATH/TO/recpre is the `recpre` folder of seal-rg/recurrent-pretraining (it holds
`raven_modeling_minimal.py` and `raven_config_minimal.py`). The reference needs torch and
transformers 4.53.x (4.51 breaks its generate); the script makes its own virtual environment
for them (`--venv`, default ~/.cache/tinyloop-huginn-ref) and re-runs itself there; nothing is
installed into the project's environment. The two reference files are copied into a temporary
package and are never committed.

For each tiny config (d 64, 4 heads, vocabulary 128; prelude / core / coda of 2/2/2 and 2/4/2
blocks) it writes tests/data/huginn-tiny-<name>/ by the reference's own `save_pretrained`
(config.json + model.safetensors: the `freqs_cis` buffer included, a tied head left out) and
golden.npz, all with init_scale=0 (the zero initial state):
  * logits at every position of each prompt at 1, 4 and 8 recurrence steps, and at the default
    depth (mean_recurrence);
  * the cached path: the first prompt fed token by token through a HuginnDynamicCache at 4 steps
    (each token's logits), and a prefill of its first half followed by token-by-token decoding;
  * greedy continuations by `generate_minimal` (the reference's cached generate loop) at 4 steps
    and at the default depth;
  * the spread of the reference's initial state draw at init_scale=1 over many positions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

TRANSFORMERS = "transformers==4.53.3"
TORCH = "torch==2.13.0"

# Tiny, with every feature on: q/k biases, a 2- and a 4-block core, a tied and an untied head,
# two RoPE bases. mean_recurrence is the default depth our loader must take.
COMMON = dict(n_embd=64, n_heads=4, vocab_size=128, intermediate_size=96, block_size=256, n_layers_in_prelude=2,
              n_layers_in_coda=2, qk_bias=True, norm_eps=1e-6, bias=False)
CONFIGS = {
    "222": dict(COMMON, n_layers_in_recurrent_block=2, mean_recurrence=4, rope_base=50_000, tie_embeddings=True),
    "242": dict(COMMON, n_layers_in_recurrent_block=4, mean_recurrence=3, rope_base=10_000, tie_embeddings=False),
}
PROMPT_LENS = (6, 29)
STEPS = (1, 4, 8)
CACHED_STEPS = 4
GREEDY_TOKENS = 10
STATE_DRAW = (1, 4096)  # positions of the initial-state draw (x n_embd values)


def ensure_env(venv: str) -> None:
    """Re-run this script in a venv with the reference's dependencies (made on first use)."""
    try:
        import torch  # noqa: F401
        import transformers
        if transformers.__version__.startswith("4.53."):
            return
    except ImportError:
        pass
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        print(f"making {venv} ({TORCH}, {TRANSFORMERS}) ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call([py, "-m", "pip", "install", "-q", TORCH, TRANSFORMERS, "safetensors", "numpy"])
    os.execv(py, [py, *sys.argv])


def randomize(model, seed: int) -> None:
    """The reference's own initialisation keeps its norms at 1 and its q/k biases at 0; give
    them values so that every term moves the logits: norm weights ~ 1 + N(0, 0.1), biases ~
    N(0, 0.1). The matrices keep the reference's (small, contracting) init, so that 8 steps of
    a random core stay well-conditioned."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("qk_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recpre", help="the recpre folder of seal-rg/recurrent-pretraining")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data"))
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tinyloop-huginn-ref"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    files = ("raven_modeling_minimal.py", "raven_config_minimal.py")
    for name in files:
        if not os.path.isfile(os.path.join(args.recpre, name)):
            sys.exit(f"{args.recpre}: no {name}")
    ensure_env(args.venv)

    import numpy as np
    import torch
    import transformers
    from transformers import GenerationConfig

    pkg_root = tempfile.mkdtemp()
    pkg = os.path.join(pkg_root, "raven_ref")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    for name in files:
        shutil.copy(os.path.join(args.recpre, name), os.path.join(pkg, name))
    sys.path.insert(0, pkg_root)
    from raven_ref.raven_config_minimal import RavenConfig
    from raven_ref.raven_modeling_minimal import HuginnDynamicCache, RavenForCausalLM

    torch.set_num_threads(2)
    for k, (name, fields) in enumerate(CONFIGS.items()):
        torch.manual_seed(args.seed + k)
        model = RavenForCausalLM(RavenConfig(**fields)).eval()
        randomize(model, args.seed + k)
        out = os.path.abspath(os.path.join(args.out, f"huginn-tiny-{name}"))
        if os.path.isdir(out):
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        for extra in os.listdir(out):  # save_pretrained copies the reference's code in: never committed
            if extra.endswith(".py") or extra == "generation_config.json":
                os.remove(os.path.join(out, extra))

        rng = np.random.default_rng(args.seed + k)
        golden = {"transformers_version": np.array(transformers.__version__),
                  "torch_version": np.array(torch.__version__), "steps": np.array(STEPS, np.int32)}
        with torch.no_grad():
            for i, n in enumerate(PROMPT_LENS):
                ids = rng.integers(0, fields["vocab_size"], n)
                x = torch.tensor(ids[None], dtype=torch.long)
                golden[f"prompt_{i}"] = ids.astype(np.int32)
                for s in STEPS:
                    golden[f"logits_s{s}_{i}"] = model(x, num_steps=s, init_scale=0.0).logits[0].numpy()
                golden[f"logits_default_{i}"] = model(x, init_scale=0.0).logits[0].numpy()
                for key, steps in (("greedy", CACHED_STEPS), ("greedy_default", None)):
                    kw = {} if steps is None else {"num_steps": steps}
                    seq = model.generate_minimal(x, GenerationConfig(do_sample=False), init_scale=0.0,
                                                 max_new_tokens=GREEDY_TOKENS, **kw)
                    golden[f"{key}_{i}"] = seq[0, n:].numpy().astype(np.int32)

            ids = torch.tensor(golden["prompt_1"][None].astype(np.int64))
            cache, rows = HuginnDynamicCache(), []
            for t in range(ids.shape[1]):  # token by token through the cache
                o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([t]),
                          num_steps=CACHED_STEPS, init_scale=0.0)
                rows.append(o.logits[0, -1].numpy())
            golden["cached_token_by_token"] = np.stack(rows)
            half = ids.shape[1] // 2
            cache = HuginnDynamicCache()
            o = model(ids[:, :half], past_key_values=cache, use_cache=True, cache_position=torch.arange(half),
                      num_steps=CACHED_STEPS, init_scale=0.0)
            rows = [o.logits[0, -1].numpy()]
            for t in range(half, ids.shape[1]):
                o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([t]),
                          num_steps=CACHED_STEPS, init_scale=0.0)
                rows.append(o.logits[0, -1].numpy())
            golden["cached_prefill_then_decode"] = np.stack(rows)  # positions half-1 .. n-1
            golden["cached_half"] = np.array(half, np.int32)

            draw = model.initialize_state(torch.zeros(*STATE_DRAW, fields["n_embd"]), scale=1.0)
            golden["ref_state_std"] = np.array(float(draw.std()), np.float64)
            golden["ref_state_absmax"] = np.array(float(draw.abs().max()), np.float64)
        np.savez(os.path.join(out, "golden.npz"), **golden)
        with open(os.path.join(out, "config.json")) as f:
            saved = json.load(f)
        print(f"wrote {out}: model_type={saved['model_type']}, {len(PROMPT_LENS)} prompts, "
              f"tensors in model.safetensors, golden.npz")
    shutil.rmtree(pkg_root)


if __name__ == "__main__":
    main()
