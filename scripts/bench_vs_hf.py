"""Side by side with Hugging Face `transformers` on one GPT-2-small-shaped model.

    pip install -e ".[hf]"     # here: pip install torch==2.13.0 (a CPU wheel) + transformers
    python scripts/bench_vs_hf.py              # ~5 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_vs_hf.py --quick      # tiny model, nothing written

Same seeded random weights in both systems (built by transformers, imported with
`Model.from_hf_gpt2`), float32. Workload: one shared prefix, N requests each with its own
suffix, greedy tokens. Arms:
  HF full       `model.generate(prefix + suffix)` per request
  HF reuse      prefix run once into a DynamicCache, `copy.deepcopy` of it per request (HF's
                documented prompt-reuse recipe), `generate(..., past_key_values=copy)`
  ours NO_CACHE `Model.generate(prefix + suffix)` per request
  ours SHARED   `build_prefix_cache(prefix)` once, `generate_from_prefix_cache` per request
  ours SHARED-BATCHED  the prefix once, all N requests decoded together
                `generate_batch_from_prefix_cache` (the prefix read once per step for all)
All arms must emit the same tokens (checked first). Wall time per arm includes building its
prefix; median of `--repeats` runs. Then batch-1 decode tokens/s of each system from the
same prompt: (t[33 tokens] - t[1 token]) / 32.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

import tinyloop_jax as tl  # noqa: E402


def hf_model(quick: bool, out: str):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    kw = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=256) if quick else {}
    cfg = GPT2Config(**kw)  # defaults: GPT-2 small (12 layers, D 768, 12 heads, vocab 50257)
    model = GPT2LMHeadModel(cfg).eval()
    model.generation_config.eos_token_id = None  # emit exactly max_new_tokens, like ours
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out, safe_serialization=True)
    return model


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action=_report.NoWrite)
    args = ap.parse_args()
    if args.quick:
        args.prefix, args.n, args.repeats = 64, 3, 1

    import torch
    from transformers import DynamicCache

    torch.set_num_threads(os.cpu_count())
    tmp = tempfile.mkdtemp()
    hf = hf_model(args.quick, tmp)
    ours = tl.Model.from_hf_gpt2(tmp, kv_mode="fp32")
    V = hf.config.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, V, args.prefix)
    suffixes = [rng.integers(0, V, args.suffix) for _ in range(args.n)]
    full = [np.concatenate([prefix, s]) for s in suffixes]
    new = args.new

    # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes in 6.0)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"

    @torch.no_grad()
    def hf_gen(ids, past=None):
        kw = {cache_kw: past} if past is not None else {}
        return hf.generate(torch.from_numpy(ids[None]), max_new_tokens=new, do_sample=False, **kw)[0].tolist()

    @torch.no_grad()
    def hf_prefix():
        out = hf(torch.from_numpy(prefix[None]), use_cache=True, **{cache_kw: DynamicCache(config=hf.config)})
        return getattr(out, cache_kw)

    def arm_hf_full():
        return [hf_gen(f) for f in full]

    def arm_hf_reuse():
        cache = hf_prefix()
        return [hf_gen(f, copy.deepcopy(cache)) for f in full]

    def arm_no_cache():
        return [ours.generate(f, max_tokens=new) for f in full]

    def arm_shared():
        pre = ours.build_prefix_cache(prefix)
        return [pre.prompt.tolist() + ours.generate_from_prefix_cache(pre, suffix=s, max_tokens=new)[len(prefix):]
                for s in suffixes]

    def arm_batched():
        pre = ours.build_prefix_cache(prefix)
        return ours.generate_batch_from_prefix_cache(pre, suffixes, max_tokens=new)

    arms = {"HF full prompt": arm_hf_full, "HF prefix reuse (deepcopy)": arm_hf_reuse,
            "ours NO_CACHE": arm_no_cache, "ours SHARED": arm_shared, "ours SHARED-BATCHED": arm_batched}
    outs = {}
    for i, (name, fn) in enumerate(arms.items()):  # warm-up run doubles as the correctness check
        _report.progress(i, len(arms), f"check {name}")
        outs[name] = fn()
    ref = outs["HF full prompt"]
    agree = {name: float(np.mean([np.array_equal(a, b) for a, b in zip(o, ref)])) for name, o in outs.items()}
    for name, a in agree.items():
        if a < 1:
            sys.exit(f"{name} emitted different tokens than HF full prompt on {100 * (1 - a):.0f}% of requests")
    times = {}
    for i, (name, fn) in enumerate(arms.items()):
        _report.progress(i, len(arms), f"time {name}")
        times[name] = _report.median_time(fn, args.repeats, warmup=0)
    _report.progress(len(arms), len(arms), "decode tok/s")

    prompt = full[0]

    def per_step(gen):
        t33 = _report.median_time(lambda: gen(33), args.repeats)
        t1 = _report.median_time(lambda: gen(1), args.repeats)
        return (t33 - t1) / 32

    @torch.no_grad()
    def hf_n(n):
        hf.generate(torch.from_numpy(prompt[None]), max_new_tokens=n, do_sample=False)

    step_hf = per_step(hf_n)
    step_ours = per_step(lambda n: ours.generate(prompt, max_tokens=n))

    tokens = args.n * new
    base = times["HF prefix reuse (deepcopy)"]
    import transformers

    shape = "GPT-2 small (12 layers, D 768, 12 heads, vocab 50257)" if not args.quick else "tiny GPT-2"
    lines = [
        "## Side by side with Hugging Face transformers (`scripts/bench_vs_hf.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}; torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}  ",
        f"Model: {shape}, random weights (seed 0) built by transformers and imported with "
        f"`Model.from_hf_gpt2`, float32 in both. Workload: a {args.prefix}-token prefix, N = {args.n} requests "
        f"each with a different {args.suffix}-token suffix, {new} greedy tokens. All arms emitted "
        f"identical tokens (checked). Wall time for all N requests including building the prefix, "
        f"median of {args.repeats}.",
        "",
        "| arm | wall s | generated tok/s | throughput vs HF prefix reuse |",
        "|---|---|---|---|",
    ]
    for name, t in times.items():
        lines.append(f"| {name} | {t:.2f} | {tokens / t:.1f} | {base / t:.2f}× |")
    lines += ["", f"Batch-1 decode from a {len(prompt)}-token prompt: HF {1 / step_hf:.1f} tok/s, "
              f"ours {1 / step_ours:.1f} tok/s (ours / HF = {step_hf / step_ours:.2f}×)."]
    print("\n".join(lines))
    if not args.quick:
        print("wrote", _report.write_section("bench_vs_hf", "\n".join(lines)))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
