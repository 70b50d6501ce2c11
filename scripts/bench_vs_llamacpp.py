"""llama.cpp and tinyloop-jax side by side on the same GGUF file (SmolLM2-135M-Instruct, Q4_1 body
+ Q8_0 embedding; or Gemma 3 270M Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K), the same token ids and the
same thread count, back to back in one session.

    python scripts/bench_vs_llamacpp.py              # writes the "vs-llamacpp" section of docs/benchmarks.md
    python scripts/bench_vs_llamacpp.py --model gemma3-270m    # the "vs-llamacpp-gemma3" section

llama.cpp runs through its Python binding, `llama-cpp-python` (PIN), compiled from its source
package into a side venv ($TINYLOOP_HOME/venvs/llama-cpp-<isa>-noamx, `_llama_build.binding()`, built
with the flags of bench_vs_llamaserver.py's programs; never a project dependency) the first
time (7 min 54 s on this 2-core machine, with nothing else running). Measured, each a median of `--repeats`:
- prompt processing tok/s (128 and 512 tokens), batch-1 greedy decode tok/s (128 tokens, the
  per-step time from two generation lengths off one prompt);
- greedy tokens of 5 prompts, 32 each (llama.cpp quantizes activations to 8 bits in its dot
  products, we compute them in float32: the first divergence is reported);
- prefix reuse: a 512-token system prompt + 10 questions of 16 tokens, 16 new tokens each:
  llama.cpp re-evaluating the prompt every time, llama.cpp restoring a state saved after the
  system prompt (`save_state` / `load_state`), ours SHARED (one prefix, one request at a time)
  and SHARED-BATCHED (one prefix, the 10 questions as one batch).
Ours runs the file as stored (packed, `quantize_weights=None`) and dequantized to float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from _llama_build import PIN, binding  # noqa: E402

LLAMA_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama

spec = json.loads(sys.argv[1])
t = time.perf_counter()
llm = Llama(model_path=spec["path"], n_ctx=2048, n_batch=512, n_threads=spec["threads"],
            n_threads_batch=spec["threads"], verbose=False)
out = {"load": time.perf_counter() - t}

def med(f):
    f()
    ts = []
    for _ in range(spec["repeats"]):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

def greedy(ids, n, reset=True):
    if reset:
        llm.reset()
    llm.eval(ids)
    toks = []
    for i in range(n):
        # the last evaluated token's logits (the binding keeps no copy without logits_all)
        tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
        toks.append(tok)
        if i + 1 < n:
            llm.eval([tok])
    return toks

ids = spec["long"]
for n in (128, 512):
    out[f"pp{n}"] = med(lambda: (llm.reset(), llm.eval(ids[:n])))
p = ids[:128]
out["long"] = med(lambda: greedy(p, spec["new"] + 1))
out["short"] = med(lambda: greedy(p, 1))
out["tokens"] = [greedy(q, 32) for q in spec["prompts"]]
system, questions, k = spec["system"], spec["questions"], spec["answer"]
out["reeval"] = med(lambda: [greedy(system + q, k) for q in questions])
def restore():
    llm.reset(); llm.eval(system); state = llm.save_state()
    res = []
    for q in questions:
        llm.load_state(state)
        res.append(greedy(q, k, reset=False))
    return res
out["restore"] = med(restore)
out["restore_tokens"] = restore()
print(json.dumps(out))
"""


def first_diff(a: list, b: list):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def ours(model, spec: dict, repeats: int) -> dict:
    import numpy as np

    import _report

    ids = np.asarray(spec["long"], np.int32)
    out = {f"pp{n}": _report.median_time(lambda n=n: np.asarray(model.next_token_logits(ids[:n])), repeats)
           for n in (128, 512)}
    prefix = model.build_prefix_cache(ids[:128])
    out["long"] = _report.median_time(lambda: model.generate_from_prefix_cache(prefix, max_tokens=spec["new"] + 1),
                                      repeats)
    out["short"] = _report.median_time(lambda: model.generate_from_prefix_cache(prefix, max_tokens=1), repeats)
    out["tokens"] = [model.generate(np.asarray(q, np.int32), max_tokens=32)[len(q):] for q in spec["prompts"]]
    system, questions, k = (np.asarray(spec["system"], np.int32), [np.asarray(q, np.int32) for q in spec["questions"]],
                            spec["answer"])

    def shared():
        p = model.build_prefix_cache(system)
        return [model.generate_from_prefix_cache(p, max_tokens=k, suffix=q)[len(system) + len(q):] for q in questions]

    def batched():
        p = model.build_prefix_cache(system)
        return [r[len(system) + len(q):] for r, q in
                zip(model.generate_batch_from_prefix_cache(p, questions, max_tokens=k), questions)]
    out["shared"], out["batched"] = _report.median_time(shared, repeats), _report.median_time(batched, repeats)
    out["shared_tokens"] = shared()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "gemma3-270m"])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    import jax
    import numpy as np

    import _report
    import tinyloop_jax as tl
    from bench_decode import gemv_bandwidth
    from bench_smollm2 import PARAGRAPH, QUESTIONS

    threads = os.cpu_count()
    path = tl.model_path(args.model)
    tok = tl.load_tokenizer(path)
    label = {"smollm2": "SmolLM2-135M-Instruct Q4_1 (embedding Q8_0)",
             "gemma3-270m": "Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K)"}[args.model]
    bos = tok.special_tokens.get("bos_token") if args.model == "gemma3-270m" else None  # Gemma reads <bos> first
    lead = [] if bos is None else tok.encode(bos, special=False).tolist()
    text = np.asarray(lead + tok.encode(PARAGRAPH * 40, special=False).tolist(), np.int32)
    questions = [(tok.encode(q + " Answer briefly, please, in one short line of text.", special=False).tolist()
                  + [0] * 16)[:16] for q in (QUESTIONS * 2)[:10]]
    prompts = [lead + tok.encode(p, special=False).tolist() for p in
               ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot",
                "The three primary colors are", "Water boils at a temperature of"]]
    spec = dict(path=path, threads=threads, repeats=args.repeats, new=args.new, long=text[:512].tolist(),
                prompts=prompts, system=text[:512].tolist(), questions=questions, answer=16)

    python = binding()
    t = time.perf_counter()
    r = subprocess.run([python, "-c", LLAMA_SCRIPT, json.dumps(spec)], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"llama.cpp run failed:\n{r.stderr[-3000:]}")
    cpp = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"llama.cpp ran in {time.perf_counter() - t:.0f} s", file=sys.stderr)

    bw = gemv_bandwidth()
    rows = {}
    for name, weights in (("packed", None), ("float32", "float")):
        t = time.perf_counter()
        model = tl.Model.from_pretrained(path, kv_mode="fp32", dtype="float32", quantize_weights=weights)
        load = time.perf_counter() - t
        rows[name] = dict(ours(model, spec, args.repeats), load=load, nbytes=model.nbytes)
        c = model.weights.config
        kv = c.n_cache_layers(1) * 2 * (128 + args.new / 2) * c.kv_dim * 4
        rows[name]["bound"] = (model.nbytes + kv) / bw
        del model
        jax.clear_caches()

    def decode(d):
        return args.new / (d["long"] - d["short"])

    lines = [f"Command: `{_report.command()}`. Machine: {_report.machine()}; {threads} threads for both. "
             f"{PIN} built here from its source package. The same token ids on both sides; {label}. Medians of "
             f"{args.repeats}. Bandwidth (float32 GEMV): {bw / 1e9:.1f} GB/s.", "",
             "| | weights MiB | prefill 128 tok/s | prefill 512 tok/s | decode tok/s | decode vs bound | load s |",
             "|---|---|---|---|---|---|---|"]
    lines.append(f"| llama.cpp (the file) | {os.path.getsize(path) / 2**20:.0f} (file) | {128 / cpp['pp128']:.0f} | "
                 f"{512 / cpp['pp512']:.0f} | {decode(cpp):.1f} | | {cpp['load']:.2f} |")
    for name, d in rows.items():
        step = (d["long"] - d["short"]) / args.new
        lines.append(f"| tinyloop-jax, {'file as stored (packed)' if name == 'packed' else 'dequantized float32'} | "
                     f"{d['nbytes'] / 2**20:.0f} | {128 / d['pp128']:.0f} | {512 / d['pp512']:.0f} | {1 / step:.1f} | "
                     f"{100 * d['bound'] / step:.0f}% | {d['load']:.2f} |")
    p, f = rows["packed"], rows["float32"]
    lines += ["", f"Decode, ours packed vs llama.cpp: **{decode(p) / decode(cpp):.2f}x**; ours packed vs our float32: "
              f"**{decode(p) / decode(f):.2f}x**.", "",
              "Prefix reuse: a 512-token system prompt, 10 questions of 16 tokens, 16 greedy tokens each "
              "(total seconds for the 10, the system prompt's evaluation included):", "",
              "| | seconds | vs llama.cpp re-evaluating |", "|---|---|---|",
              f"| llama.cpp, re-evaluating the prompt | {cpp['reeval']:.2f} | 1.00x |",
              f"| llama.cpp, save_state / load_state | {cpp['restore']:.2f} | {cpp['reeval'] / cpp['restore']:.2f}x |",
              f"| ours packed, SHARED | {p['shared']:.2f} | {cpp['reeval'] / p['shared']:.2f}x |",
              f"| ours packed, SHARED-BATCHED | {p['batched']:.2f} | {cpp['reeval'] / p['batched']:.2f}x |",
              f"| ours float32, SHARED-BATCHED | {f['batched']:.2f} | {cpp['reeval'] / f['batched']:.2f}x |", "",
              "Greedy tokens, first divergence from llama.cpp (32 tokens per prompt; None = identical):", ""]
    for i, q in enumerate(spec["prompts"]):
        lines.append(f"- prompt {i}: packed {first_diff(p['tokens'][i], cpp['tokens'][i])}, "
                     f"float32 {first_diff(f['tokens'][i], cpp['tokens'][i])}")
    same = sum(a == b for a, b in zip(p["shared_tokens"], cpp["restore_tokens"]))
    lines.append(f"- prefix-reuse answers identical to llama.cpp's: {same} of {len(questions)}")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        if args.model == "smollm2":
            title, section = "## llama.cpp side by side, same GGUF (issue 23)\n\n", "vs-llamacpp"
        else:
            title, section = "## llama.cpp side by side: Gemma 3 270M Q4_K_M (issue 47)\n\n", "vs-llamacpp-gemma3"
        print("wrote", _report.write_section(section, title + body))


if __name__ == "__main__":
    main()
