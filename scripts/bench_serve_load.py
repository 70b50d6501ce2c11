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
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

from _report import command, machine, write_section  # noqa: E402

TOPICS = ["a public library", "a city bicycle-sharing scheme", "a mountain hut", "a community swimming pool"]
RULES = ["Opening hours are nine to seven on weekdays and ten to five on Saturdays; it is closed on Sundays.",
         "Members pay twelve euros a year; residents of the town pay nothing.",
         "Bookings are made online at least two days ahead, and cancelled free of charge up to a day before.",
         "Children under twelve must be accompanied by an adult at all times.",
         "Lost cards are replaced for two euros at the front desk.",
         "Late returns cost twenty cents a day per item, capped at five euros.",
         "Groups of more than ten people must call ahead and are given a guide.",
         "Pets are not allowed inside, except assistance dogs.",
         "The wireless network is open to everyone and needs no password.",
         "Lockers cost one euro, returned when the key is handed back."]


def system_prompt(i: int) -> str:
    """One of the shared system prompts: a few hundred tokens of house rules."""
    rules = " ".join(RULES[(i + j) % len(RULES)] for j in range(len(RULES)))
    return (f"You are the assistant of {TOPICS[i]}. You answer questions from visitors about its rules, prices "
            f"and services, briefly and politely, in one or two sentences. These are the rules. {rules} "
            f"If you do not know an answer, say so and suggest asking at the front desk. {rules}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.read().decode()


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def one_request(client, system: str, question: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    stream = client.chat.completions.create(
        model="smollm2", messages=[dict(role="system", content=system), dict(role="user", content=question)],
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
    return dict(ttft=times[0] - t0 if times else float("nan"), itl=list(np.diff(times)),
                latency=time.perf_counter() - t0, chunks=len(times))


def load(port: int, clients: int, per_client: int, max_tokens: int, seed: int) -> dict:
    """`clients` threads, each sending `per_client` requests back to back; Zipf over the system
    prompts (prompt i with weight 1 / (i + 1))."""
    import openai
    rng = np.random.default_rng(seed)
    w = 1 / np.arange(1, len(TOPICS) + 1)
    picks = rng.choice(len(TOPICS), size=(clients, per_client), p=w / w.sum())
    results, lock = [], threading.Lock()

    def run(c):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        for j in range(per_client):
            r = one_request(client, system_prompt(int(picks[c, j])), f"Question {c}-{j}: may I come at {7 + j} "
                            f"with {c % 5 + 1} friends?", max_tokens)
            with lock:
                results.append(r)

    before = time.perf_counter()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - before
    return dict(results=results, wall=wall)


def metric(port: int, name: str) -> float:
    return float(next(line.split()[-1] for line in get(port, "/metrics").splitlines() if line.startswith(name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    port = free_port()
    cache = tempfile.mkdtemp(prefix="tinyloop-xla-")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop_jax.cli", "serve", "--model", "smollm2", "--port",
                             str(port), "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    rows = []
    try:
        while True:
            try:
                health = json.loads(get(port, "/health"))
                break
            except OSError:
                assert proc.poll() is None, "the server exited"
                time.sleep(0.2)
        t_health = time.perf_counter() - t0
        while health.get("warming", False):
            time.sleep(0.5)
            health = json.loads(get(port, "/health"))
        t_warm = time.perf_counter() - t0
        print(f"/health after {t_health:.1f} s, warmup done after {t_warm:.1f} s", flush=True)
        import openai
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        for i in range(len(TOPICS)):  # the warm-up pass: each system prompt's pages in the pool
            one_request(client, system_prompt(i), "Hello?", 4)
        for n in [int(x) for x in args.clients.split(",")]:
            out = load(port, n, args.per_client, args.max_tokens, seed=n)
            res = out["results"]
            tokens = sum(r["chunks"] for r in res)
            itl = [x for r in res for x in r["itl"]]
            row = dict(clients=n, tps=tokens / out["wall"], ttft50=pct([r["ttft"] for r in res], 50),
                       ttft99=pct([r["ttft"] for r in res], 99), itl50=pct(itl, 50) * 1e3, itl99=pct(itl, 99) * 1e3,
                       lat50=pct([r["latency"] for r in res], 50), rss=peak_rss(proc.pid) / 2**30)
            rows.append(row)
            print(f"{n} clients: {row['tps']:.1f} tok/s, TTFT p50 {row['ttft50']:.2f} p99 {row['ttft99']:.2f} s, "
                  f"ITL p50 {row['itl50']:.0f} p99 {row['itl99']:.0f} ms, peak RSS {row['rss']:.2f} GiB", flush=True)
        compiles = metric(port, "tinyloop_compiles_after_warmup_total")
        batch = metric(port, "tinyloop_mean_batch_size") if "tinyloop_mean_batch_size" in get(port, "/metrics") \
            else float("nan")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = ["## `tinyloop serve --model smollm2` under load (issue 45, `scripts/bench_serve_load.py`)", "",
             f"`{command()}` on {machine()}.", "",
             f"Start-up on an empty compilation cache: /health after {t_health:.1f} s, the background warmup (every "
             f"step program) done after {t_warm:.1f} s; programs compiled after the warmup, over the whole load: "
             f"{compiles:.0f}. Chat completions of {args.max_tokens} tokens (`ignore_eos`, greedy, streamed) over 4 "
             f"shared system prompts (Zipf), {args.per_client} requests per client back to back, after a warm-up "
             "request per system prompt.", "",
             "| clients | tok/s | TTFT p50 / p99 (s) | inter-token p50 / p99 (ms) | latency p50 (s) "
             "| server peak RSS (GiB) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['tps']:.1f} | {r['ttft50']:.2f} / {r['ttft99']:.2f} | "
                     f"{r['itl50']:.0f} / {r['itl99']:.0f} | {r['lat50']:.2f} | {r['rss']:.2f} |")
    if len(rows) > 1:
        lines += ["", f"{rows[-1]['clients']} clients give {rows[-1]['tps'] / rows[0]['tps']:.2f}x the tokens/s of "
                  f"{rows[0]['clients']}; mean decode batch over the run: {batch:.1f} rows."]
    body = "\n".join(lines)
    print(body)
    if not args.no_write:
        write_section("bench_serve_load", body)


if __name__ == "__main__":
    main()
