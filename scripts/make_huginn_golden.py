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

With --share it loads the 2/4/2 folder and writes share.npz beside it: the reference's cache
with `lookup_strategy` "compress-s4" and "compress-s8" (every pass reading one recurrence's
blocks: our kv_share "last" = ring:1, and ring:2, its core being 4 blocks), at 4 steps and
init_scale=0: each prompt prefilled in one call, then the greedy tokens fed one at a time
through that cache — the logits of every decode step and the tokens; and
`generate_with_adaptive_compute` with "latest-m4-compress-s4" and kl exits (8 steps; with and
without exits in the prefill): the tokens and the passes each ran.

With --adaptive it instead loads the 2/4/2 folder written before (the reference's latest-m4
lookup hard-codes a 4-block core) and writes adaptive.npz beside it:
`generate_with_adaptive_compute(cache_lookup_strategy="latest-m4", init_scale=0, num_steps=8)`
greedy tokens and the passes run for each token (counted by wrapping the reference's
`iterate_one_step`), for each criterion at two thresholds, with and without
`do_not_exit_in_prefill` and `continuous_compute`, plus min_steps / check_every cases.
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
ADAPTIVE_STEPS, ADAPTIVE_TOKENS = 8, 12
THRESHOLDS = {"kl": (1e-3, 1e-2), "entropy-diff": (1e-3, 1e-2), "latent-diff": (0.1, 0.3), "cosine": (1e-2, 5e-2),
              "argmax-stability": (2, 5)}
SCHEDULES = ((0, 1), (2, 3))  # (min_steps, check_every): the defaults, and a later, sparser check


def ensure_env(venv: str) -> None:
    """Re-run this script in a venv with the reference's dependencies (made on first use)."""
    def ready():
        import torch  # noqa: F401
        import transformers
        return transformers.__version__.startswith("4.53.")
    _side_venv.reexec(venv, [TORCH, TRANSFORMERS, "safetensors", "numpy"], ready)


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
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tinyloop-huginn-ref"), type=os.path.abspath)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adaptive", action="store_true", help="write adaptive.npz for the 2/4/2 folder")
    ap.add_argument("--share", action="store_true", help="write share.npz (compressed caches) for the 2/4/2 folder")
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
    if args.share:
        share_goldens(RavenForCausalLM(RavenConfig(**CONFIGS["242"])), HuginnDynamicCache,
                      os.path.abspath(os.path.join(args.out, "huginn-tiny-242")))
        shutil.rmtree(pkg_root)
        return
    if args.adaptive:
        adaptive_goldens(RavenForCausalLM(RavenConfig(**CONFIGS["242"])),
                         os.path.abspath(os.path.join(args.out, "huginn-tiny-242")))
        shutil.rmtree(pkg_root)
        return
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


def count_passes(model) -> list:
    """A list the model appends to: one entry per generated token (its embedding call with a
    cache), counting the recurrence steps that token ran."""
    passes: list = []
    step, embed = model.iterate_one_step, model.embed_inputs

    def counted_embed(*a, **kw):  # one call per generated token (the continuous warm start's has no cache)
        if kw.get("past_key_values") is not None:
            passes.append(0)
        return embed(*a, **kw)

    def counted_step(*a, **kw):
        passes[-1] += 1
        return step(*a, **kw)

    model.embed_inputs, model.iterate_one_step = counted_embed, counted_step
    return passes


SHARE_STRATEGIES = {"compress-s4": "last", "compress-s8": "ring:2"}  # (a 4-block core)
SHARE_STEPS, SHARE_TOKENS = 4, 12


def load_242(model, folder: str):
    import torch  # noqa: F401
    from safetensors.torch import load_file

    missing, unexpected = model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")), strict=False)
    if missing or unexpected:
        sys.exit(f"{folder}: the saved tensors do not fit the 2/4/2 config: missing {missing}, unexpected {unexpected}")
    return model.eval()


def share_goldens(model, cache_class, folder: str) -> None:
    """share.npz: greedy decoding through the reference's compressed caches (see the module doc)."""
    import numpy as np
    import torch
    from transformers import GenerationConfig

    model = load_242(model, folder)
    golden = dict(np.load(os.path.join(folder, "golden.npz")))
    out = {"steps": np.array(SHARE_STEPS, np.int32), "strategies": np.array(json.dumps(SHARE_STRATEGIES))}
    with torch.no_grad():
        for strategy in SHARE_STRATEGIES:
            for i in range(len(PROMPT_LENS)):
                ids = torch.tensor(golden[f"prompt_{i}"][None].astype(np.int64))
                n = ids.shape[1]
                cache = cache_class(lookup_strategy=strategy)
                o = model(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(n),
                          num_steps=SHARE_STEPS, init_scale=0.0)
                logits, tokens = [o.logits[0, -1].numpy()], []
                for t in range(SHARE_TOKENS):
                    tokens.append(int(np.argmax(logits[-1])))
                    if t == SHARE_TOKENS - 1:
                        break
                    o = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True,
                              cache_position=torch.tensor([n + t]), num_steps=SHARE_STEPS, init_scale=0.0)
                    logits.append(o.logits[0, -1].numpy())
                out[f"{strategy}_{i}_logits"] = np.stack(logits)  # [tokens, V]: the logits each token was chosen from
                out[f"{strategy}_{i}_tokens"] = np.array(tokens, np.int32)
                print(strategy, i, tokens)
    # adaptive depth through the compressed cache (its default generator's lookup): kl exits
    passes = count_passes(model)
    with torch.no_grad():
        for i in range(len(PROMPT_LENS)):
            x = torch.tensor(golden[f"prompt_{i}"][None].astype(np.int64))
            for thr in THRESHOLDS["kl"]:
                for no_prefill_exit in (False, True):
                    passes.clear()
                    seq = model.generate_with_adaptive_compute(
                        x, GenerationConfig(do_sample=False), criterion="kl", exit_threshold=thr, init_scale=0.0,
                        cache_lookup_strategy="latest-m4-compress-s4", do_not_exit_in_prefill=no_prefill_exit,
                        num_steps=ADAPTIVE_STEPS, max_new_tokens=ADAPTIVE_TOKENS)
                    key = f"adaptive_{i}_{thr}_{int(no_prefill_exit)}"
                    out[f"{key}_tokens"] = seq[0, x.shape[1]:].numpy().astype(np.int32)
                    out[f"{key}_passes"] = np.array(passes, np.int32)
                    print(key, out[f"{key}_tokens"].tolist(), passes)
    out["adaptive_steps"] = np.array(ADAPTIVE_STEPS, np.int32)
    np.savez(os.path.join(folder, "share.npz"), **out)
    print(f"wrote {folder}/share.npz")


def adaptive_goldens(model, folder: str) -> None:
    """adaptive.npz: the reference's adaptive-compute generator on the saved 2/4/2 model (its
    tensors loaded into a model of the same config)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    missing, unexpected = model.load_state_dict(load_file(os.path.join(folder, "model.safetensors")), strict=False)
    if missing or unexpected:
        sys.exit(f"{folder}: the saved tensors do not fit the 2/4/2 config: missing {missing}, unexpected {unexpected}")
    model.eval()
    golden = dict(np.load(os.path.join(folder, "golden.npz")))
    passes = count_passes(model)
    out, cases = {}, []
    for i in range(len(PROMPT_LENS)):
        x = torch.tensor(golden[f"prompt_{i}"][None].astype(np.int64))
        for crit, thresholds in THRESHOLDS.items():
            for thr in thresholds:
                for min_steps, every in SCHEDULES:
                    for no_prefill_exit in (False, True):
                        for continuous in (False, True):
                            if (min_steps, every) != (0, 1) and (continuous or thr != thresholds[1]):
                                continue
                            passes.clear()
                            with torch.no_grad():
                                seq = model.generate_with_adaptive_compute(
                                    x, GenerationConfig(do_sample=False), criterion=crit, exit_threshold=thr,
                                    init_scale=0.0, cache_lookup_strategy="latest-m4",
                                    do_not_exit_in_prefill=no_prefill_exit, continuous_compute=continuous,
                                    min_steps=min_steps, check_criterion_every_n_steps=every,
                                    num_steps=ADAPTIVE_STEPS, max_new_tokens=ADAPTIVE_TOKENS)
                            key = f"case{len(cases)}"
                            cases.append(dict(key=key, prompt=i, criterion=crit, threshold=thr, min_steps=min_steps,
                                              check_every=every, exit_in_prefill=not no_prefill_exit,
                                              continuous_compute=continuous))
                            out[f"{key}_tokens"] = seq[0, x.shape[1]:].numpy().astype(np.int32)
                            out[f"{key}_passes"] = np.array(passes, np.int32)
                            print(key, crit, thr, min_steps, every, no_prefill_exit, continuous, passes)
    out["cases"] = np.array(json.dumps(cases))
    out["steps"] = np.array(ADAPTIVE_STEPS, np.int32)
    np.savez(os.path.join(folder, "adaptive.npz"), **out)
    print(f"wrote {folder}/adaptive.npz: {len(cases)} cases")


if __name__ == "__main__":
    main()
