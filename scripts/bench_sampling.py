"""Sampled decode next to greedy (issue 58): `Model.generate` at batch 1 and the engine at 16 rows,
SmolLM2-135M-Instruct as shipped, greedy and temperature 0.8 with and without top_k / top_p; and
how often a real model's rows need the wider paths of `sampling.cut` (the top 1,024, the sort).

    python scripts/bench_sampling.py              # writes the "bench_sampling" section of docs/benchmarks.md
    python scripts/bench_sampling.py --no-write --repeats 3

Decode tok/s = tokens / (time for n + 1 tokens - time for 1): the prompt's prefill is left out
(the prompt is the same for every knob). The served comparison with llama.cpp is
`bench_vs_llamaserver.py --sampling ...`.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from _report import command, machine, median_time, write_section  # noqa: E402

# name -> the knobs of a request (SamplingParams' defaults otherwise: top_k 50, top_p 1)
KNOBS = {"greedy": dict(temperature=0.0),
         "t=0.8 (top_k 50, the default)": dict(temperature=0.8),
         "t=0.8, top_k 0 (temperature only)": dict(temperature=0.8, top_k=0),
         "t=0.8, top_k 40, top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
         "t=0.8, top_k 0, top_p 0.95": dict(temperature=0.8, top_k=0, top_p=0.95)}


def prompt(tok, n: int, row: int = 0) -> list[int]:
    """About n tokens of text: one of `_load`'s shared system prompts, cut, then a question of
    the row's own (rows of a batch share the first, not the second)."""
    from _load import question, system_prompt

    return list(tok.encode(system_prompt(row % 4)))[:n - 24] + list(tok.encode(" " + question(row, 0)))


def generate_rates(model, ids: list[int], new: int, repeats: int) -> dict:
    """tok/s of `Model.generate` at batch 1 per knob (medians)."""
    out = {}
    for name, kw in KNOBS.items():
        run = lambda n: model.generate(ids, max_tokens=n, seed=1, **kw)  # noqa: B023, E731
        long_, short = median_time(lambda: run(new + 1), repeats), median_time(lambda: run(1), repeats)
        out[name] = new / (long_ - short)
        print(f"generate batch 1, {name}: {out[name]:.1f} tok/s", flush=True)
    return out


def engine_rates(model, prompts: list[list[int]], new: int, repeats: int) -> dict:
    """tok/s of the engine decoding len(prompts) requests at once (shared system prompts' pages
    shared)."""
    import tinyloop_jax as tl

    out = {}
    rows = len(prompts)
    with tl.Engine(model, max_batch=rows) as eng:
        for name, kw in KNOBS.items():
            def run(n):
                for h in [eng.submit(p, max_tokens=n, seed=i, **kw) for i, p in enumerate(prompts)]:
                    h.result()
            run(new + 1)
            long_, short = median_time(lambda: run(new + 1), repeats), median_time(lambda: run(1), repeats)
            out[name] = rows * new / (long_ - short)
            print(f"engine {rows} rows, {name}: {out[name]:.1f} tok/s", flush=True)
    return out


def paths(model, ids: list[int], steps: int) -> dict:
    """How each knob's rows found their kept set over a real model's next-token logits: the
    logits after every prefix of a sampled continuation (temperature 0.8), counted by path."""
    import jax.numpy as jnp

    from tinyloop_jax.decoding import filtering as F

    text = model.generate(ids, max_tokens=steps, temperature=0.8, top_k=0, seed=3)
    logits = np.stack([np.asarray(model.next_token_logits(text[:len(ids) + i])) for i in range(steps)])
    out = {}
    for name, kw in KNOBS.items():
        if kw["temperature"] == 0:
            continue
        p = {**dict(top_k=50, top_p=1.0), **kw}
        c = F.cut(jnp.asarray(logits) / kw["temperature"], jnp.full((steps,), p["top_k"], jnp.int32),
                        jnp.full((steps,), p["top_p"], jnp.float32))
        out[name] = np.bincount(np.asarray(c.path), minlength=len(F.PATHS))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--path-steps", type=int, default=256)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--no-paths", action="store_true", help="leave out the paths' counts (a tree before them)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import tinyloop_jax as tl

    model, tok = tl.Model.from_pretrained("smollm2"), tl.load_tokenizer("smollm2")
    ids = prompt(tok, args.prompt)
    gen = generate_rates(model, ids, args.new, args.repeats)
    eng = engine_rates(model, [prompt(tok, args.prompt, r) for r in range(args.rows)], args.new, args.repeats)
    found = {} if args.no_paths else paths(model, ids, args.path_steps)
    lines = [f"`{command()}` on {machine()}, {args.label}; SmolLM2-135M-Instruct as shipped (Q4_1 body, "
             f"fp32 KV), {len(ids)}-token prompts (a shared system prompt, cut, and a question of the row's own), "
             f"{args.new} tokens decoded (prefill left out), medians of "
             f"{args.repeats}.", "",
             f"| knobs | `generate` batch 1, tok/s | / greedy | engine, {args.rows} rows, tok/s | / greedy |",
             "|---|---|---|---|---|"]
    g0, e0 = gen["greedy"], eng["greedy"]
    for name in KNOBS:
        lines.append(f"| {name} | {gen[name]:.1f} | {gen[name] / g0:.2f}x | {eng[name]:.1f} | {eng[name] / e0:.2f}x |")
    if found:
        from tinyloop_jax.decoding.filtering import PATHS

        lines += ["", f"How rows found their kept set (`filtering.cut`'s paths) over {args.path_steps} next-token "
                  "distributions of a sampled SmolLM2 continuation:", "",
                  "| knobs | " + " | ".join(PATHS) + " |", "|---" * (len(PATHS) + 1) + "|"]
        for name, counts in found.items():
            lines.append(f"| {name} | " + " | ".join(str(int(c)) for c in counts) + " |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("bench_sampling", "## Sampled decode next to greedy (`scripts/bench_sampling.py`)\n\n" + body)


if __name__ == "__main__":
    main()
