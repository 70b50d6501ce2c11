"""Side by side with Ouro's reference implementation on one random-weight Ouro-shaped model.

    python scripts/bench_vs_ouro.py PATH/TO/modeling_ouro.py          # ~20 min on 2 CPUs
    python scripts/bench_vs_ouro.py PATH/TO/modeling_ouro.py --quick  # tiny, nothing written

The reference (Ouro's `modeling_ouro.py` under PyTorch on CPU, transformers 4.54) runs in its
own virtual environment, made on first use as in scripts/make_ouro_golden.py; it builds the
seeded random model, saves it in Ouro's Hugging Face layout, and we load that folder with
`Model.from_pretrained`. float32 on both sides. Workload: one shared prefix, N requests each
with its own suffix, greedy tokens.

Reference arms. Users reuse a prompt by `copy.deepcopy` of its cache. The script first checks
the reference's cache path against its own cache-free forward; where it fails (under
transformers 4.54.1 the `UniversalTransformerCache` raises a mask/cache size mismatch as soon
as a cached prompt is continued), the reference's only correct arm is a full recompute per
token, and it is timed on `--ref-requests` of the N requests (each is the same work).
Our arms: NO_CACHE `generate(prefix + suffix)` per request; SHARED the prefix built once,
`generate_from_prefix_cache` per request; SHARED-BATCHED the N requests in one batched call.
Tokens are checked identical to the reference's. Then batch-1 decode tokens/s of each.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

FULL = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=16, head_dim=64, total_ut_steps=4, max_position_embeddings=4096)
QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, total_ut_steps=3, max_position_embeddings=512)


def workload(args, vocab: int):
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, vocab, args.prefix).tolist()
    return prefix, [rng.integers(3, vocab, args.suffix).tolist() for _ in range(args.n)]


# ---- the reference, in its own environment ---------------------------------------------------

def reference_worker(args) -> None:
    import make_ouro_golden as golden

    golden.ensure_env(args.venv)
    import torch
    from safetensors.torch import save_file

    torch.set_num_threads(os.cpu_count())
    pkg_root = tempfile.mkdtemp()
    os.makedirs(os.path.join(pkg_root, "ouro_ref"))
    open(os.path.join(pkg_root, "ouro_ref", "__init__.py"), "w").close()
    with open(os.path.join(pkg_root, "ouro_ref", "configuration_ouro.py"), "w") as f:
        f.write(golden.CONFIG_SOURCE)
    with open(args.reference) as src, open(os.path.join(pkg_root, "ouro_ref", "modeling_ouro.py"), "w") as dst:
        dst.write(src.read())
    sys.path.insert(0, pkg_root)
    from ouro_ref.configuration_ouro import OuroConfig
    from ouro_ref.modeling_ouro import OuroForCausalLM

    shape = QUICK if args.quick else FULL
    cfg = dict(golden.CONFIG, **shape, layer_types=["full_attention"] * shape["num_hidden_layers"])
    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures", "torch_dtype")}
    torch.manual_seed(0)
    model = OuroForCausalLM(OuroConfig(**fields, attn_implementation="eager")).eval()
    golden.randomize(model, 0)
    os.makedirs(args.folder, exist_ok=True)
    with open(os.path.join(args.folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(args.folder, "model.safetensors"))

    prefix, suffixes = workload(args, cfg["vocab_size"])
    out = {"cache_path": "ok"}
    with torch.no_grad():
        def full_logits(ids):
            return model(torch.tensor([ids]), use_cache=False).logits[0, -1]

        # does the cache path continue a cached prompt correctly?
        try:
            cache = model(torch.tensor([prefix]), use_cache=True).past_key_values
            got = model(torch.tensor([suffixes[0]]), past_key_values=copy.deepcopy(cache), use_cache=True).logits[0, -1]
            err = float((got - full_logits(prefix + suffixes[0])).abs().max())
            if err > 1e-3:
                out["cache_path"] = f"wrong logits (max |d| {err:.3g})"
        except Exception as e:  # noqa: BLE001 - record what the reference raises
            out["cache_path"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"

        def recompute(ids, new):
            seq = list(ids)
            for _ in range(new):
                seq.append(int(torch.argmax(full_logits(seq))))
            return seq[len(ids):]

        times, tokens = [], []
        for s in suffixes[:args.ref_requests]:
            t = time.perf_counter()
            tokens.append(recompute(prefix + s, args.new))
            times.append(time.perf_counter() - t)
        out.update(recompute_s=times, tokens=tokens)
        # batch-1 decode: one more token at this context costs a full forward without a cache
        ids = prefix + suffixes[0]
        t = time.perf_counter()
        for _ in range(3):
            full_logits(ids)
        out["decode_tok_s"] = 3 / (time.perf_counter() - t)
    with open(os.path.join(args.folder, "reference.json"), "w") as f:
        json.dump(out, f)


# ---- ours ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", help="path to Ouro's modeling_ouro.py")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--ref-requests", type=int, default=2, help="requests the reference recomputes (each is "
                    "the same work)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/tinyloop-ouro-ref"), type=os.path.abspath)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="(it writes nothing; accepted for bench.py ab)")
    args = ap.parse_args()
    if args.quick:
        args.prefix, args.n, args.new, args.repeats = 40, 3, 6, 1
    if args.worker:
        return reference_worker(args)

    import _report
    import tinyloop_jax as tl

    folder = tempfile.mkdtemp(prefix="ouro-bench-")
    argv = [sys.executable, os.path.abspath(__file__), args.reference, "--worker", "--folder", folder,
            "--prefix", str(args.prefix), "--suffix", str(args.suffix), "--new", str(args.new), "--n", str(args.n),
            "--ref-requests", str(args.ref_requests), "--venv", args.venv] + (["--quick"] if args.quick else [])
    t = time.perf_counter()
    subprocess.check_call(argv)
    print(f"reference done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    with open(os.path.join(folder, "reference.json")) as f:
        ref = json.load(f)

    model = tl.Model.from_pretrained(folder, kv_mode="fp32", dtype="float32")
    c = model.weights.config
    prefix, suffixes = workload(args, c.vocab_size)
    n, new = args.n, args.new

    def no_cache():
        return [model.generate(prefix + s, max_tokens=new) for s in suffixes]

    def shared():
        p = model.build_prefix_cache(prefix)
        return [model.generate_from_prefix_cache(p, suffix=s, max_tokens=new) for s in suffixes]

    def batched():
        p = model.build_prefix_cache(prefix)
        return model.generate_batch_from_prefix_cache(p, suffixes, max_tokens=new)

    outs = {name: fn() for name, fn in (("NO_CACHE", no_cache), ("SHARED", shared), ("SHARED-BATCHED", batched))}
    ours = [o[len(prefix) + args.suffix:] for o in outs["SHARED"]]
    same_arms = all(o == outs["SHARED"] for o in outs.values())
    same_ref = all(a == b for a, b in zip(ours, ref["tokens"]))
    times = {name: _report.median_time(fn, repeats=args.repeats, warmup=0)
             for name, fn in (("NO_CACHE", no_cache), ("SHARED", shared), ("SHARED-BATCHED", batched))}
    ref_total = float(np.median(ref["recompute_s"])) * n  # every request is the same work

    p = model.build_prefix_cache(prefix + suffixes[0])
    t1 = _report.median_time(lambda: model.generate_from_prefix_cache(p, max_tokens=1), repeats=args.repeats)
    t33 = _report.median_time(lambda: model.generate_from_prefix_cache(p, max_tokens=33), repeats=args.repeats)
    ours_tok_s = 32 / (t33 - t1)

    rows = [("reference: recompute per token (its cache path is broken, see below)", ref_total),
            ("ours NO_CACHE", times["NO_CACHE"]), ("ours SHARED", times["SHARED"]),
            ("ours SHARED-BATCHED", times["SHARED-BATCHED"])]
    lines = [f"Command: `{_report.command()}`  ", f"Machine: {_report.machine()}  ",
             f"Model: Ouro-shaped, random weights, float32: hidden {c.d_model}, {c.loop_blocks} layers looped "
             f"{c.default_loops} times ({c.n_cache_layers(c.default_loops)} cache layers), {c.n_heads} heads / "
             f"{c.n_kv_heads} KV heads, intermediate {c.intermediate_size}, vocab {c.vocab_size}  ",
             f"Workload: prefix {args.prefix} tokens, N = {n} requests, suffix {args.suffix}, {new} new tokens each "
             "(greedy)  ",
             f"Reference cache path: {ref['cache_path']}  ",
             f"Tokens: ours identical across arms: {same_arms}; identical to the reference's "
             f"({len(ref['tokens'])} requests recomputed): {same_ref}  ", "",
             "| arm | N requests, s | vs reference |", "|---|---|---|"]
    for name, s in rows:
        lines.append(f"| {name} | {s:.2f} | {ref_total / s:.1f}x |")
    lines += ["", f"Reference: {len(ref['recompute_s'])} requests timed, median {np.median(ref['recompute_s']):.2f} "
              f"s each, scaled to N = {n}.  ",
              f"Batch-1 decode at a {args.prefix + args.suffix}-token context: ours {ours_tok_s:.1f} tok/s, "
              f"reference {ref['decode_tok_s']:.2f} tok/s (a full forward per token) = "
              f"{ours_tok_s / ref['decode_tok_s']:.0f}x."]
    text = "\n".join(lines)
    print(text)
    if not (same_arms and same_ref):
        print("TOKENS DIFFER", file=sys.stderr)
    if not args.quick:
        _report.write_section("bench_vs_ouro", text)


if __name__ == "__main__":
    main()
