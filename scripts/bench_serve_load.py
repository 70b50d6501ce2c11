"""`tinyloop serve --model smollm2` as users hit it: start-up on a cold compilation cache, then N
streaming chat clients over shared system prompts (issue 45's load; issue 46 puts llama.cpp's
server beside it).

    python scripts/bench_serve_load.py                    # ~10 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_serve_load.py --clients 1,16 --no-write

1. Start-up: seconds from launching the server (an empty compilation cache) to /health, and to
   the end of its background warmup (every step program compiled); `compiles_after_warmup`
   after the load (programs compiled later).
2. Load, per client count: each client sends chat completions (one of 4 shared ~330-token system
   prompts, Zipf-chosen, plus a question of its own), 64 tokens each (`ignore_eos`), greedy,
   streamed, back to back; a warm-up pass first serves each system prompt once. Reported:
   tokens/s (tokens out / wall), TTFT p50 / p99, inter-token p50 / p99, request latency p50,
   and the server's peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _load  # noqa: E402
from _report import command, machine, write_section  # noqa: E402


def metric(url: str, name: str) -> float:
    text = _load.get(f"{url}/metrics")
    return float(next((line.split()[-1] for line in text.splitlines() if line.startswith(name)), "nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="more `tinyloop serve` flags, e.g. '--kv-memory 256M'")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    port = _load.free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=tempfile.mkdtemp(prefix="tinyloop-xla-"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop_jax.cli", "serve", "--model", "smollm2", "--port",
                             str(port), "--log-level", "warning", *args.server_args.split()], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = _load.Workload(max_tokens=args.max_tokens, per_client=args.per_client)
    rows = []
    try:
        t_health = _load.wait_healthy(url, proc)
        _load.wait_healthy(url, proc, ready=lambda body: not json.loads(body).get("warming", False))
        t_warm = time.perf_counter() - t0
        print(f"/health after {t_health:.1f} s, warmup done after {t_warm:.1f} s", flush=True)
        _load.warm(url, work)  # each system prompt's pages in the pool
        for n in [int(x) for x in args.clients.split(",")]:
            row = _load.summary(_load.load(url, work, n, seed=n), _load.peak_rss(proc.pid))
            rows.append(row)
            print(_load.line(row) + "\n" + _load.metric_lines("tinyloop serve", row), flush=True)
        compiles = metric(url, "tinyloop_compiles_after_warmup_total")
        batch = metric(url, "tinyloop_mean_batch_size")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = ["## `tinyloop serve --model smollm2` under load (issue 45, `scripts/bench_serve_load.py`)", "",
             f"`{command()}` on {machine()}.", "",
             f"Start-up on an empty compilation cache: /health after {t_health:.1f} s, the background warmup (every "
             f"step program) done after {t_warm:.1f} s; programs compiled after the warmup, over the whole load: "
             f"{compiles:.0f}. Chat completions of {args.max_tokens} tokens (`ignore_eos`, greedy, streamed) over 4 "
             f"shared system prompts (Zipf), {args.per_client} requests per client back to back, after a warm-up "
             "request per system prompt (`scripts/_load.py`).", ""]
    lines += _load.table([("tinyloop", r) for r in rows])
    if len(rows) > 1:
        lines += ["", f"{rows[-1].clients} clients give {rows[-1].tps / rows[0].tps:.2f}x the tokens/s of "
                  f"{rows[0].clients}; mean decode batch over the run: {batch:.1f} rows."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("bench_serve_load", body)


if __name__ == "__main__":
    main()
