"""Several SmolLM2 engines on Ray Serve behind one ingress, routed each way (issue 61): how much
of the prefix cache each router keeps, and what it costs or buys.

    python scripts/bench_replicas.py                          # ~25 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_replicas.py --routers prefix,round_robin --clients 16 --no-write

The trace: 8 system prompts of 400-600 tokens (SmolLM2's chat template), 16 questions each, in
a fixed-seed shuffle; `--clients` threads drain it, each request streamed (`max_tokens` tokens,
`ignore_eos`), the same trace for every router. Each router gets a fresh deployment (empty
caches): `--replicas` engines pinned to a core each, every replica's page pool sized to hold
5 of the 8 system prompts beside the pages past their prompts of the rows it serves at once
(`pool_pages_for`), and the router told
the same capacity. Beside them, one replica on one core with the same pool.

Reported per run: hit rate (cached / prompt tokens, from each answer's usage), prefill tokens
(prompt less cached), TTFT p50 / p99, tokens/s (completion tokens / wall), each replica's share
of the requests, errors; and the start-up (seconds to /health without `warming`) and resident
memory of every process of the Ray path (the driver's children: raylet, GCS, controller, proxy,
ingress, replicas) against one `tinyloop serve` process with the same engine.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _load  # noqa: E402
from _report import heading, write_section  # noqa: E402

TOPICS = ["a public library", "a city bicycle-sharing scheme", "a mountain hut", "a community swimming pool",
          "a railway museum", "a botanical garden", "a youth hostel", "a climbing gym"]


def system_prompt(i: int, n_rules: int) -> str:
    """System prompt i: the house rules of TOPICS[i], `n_rules` of them in an order of its own."""
    rules = " ".join(_load.RULES[(i * 3 + j) % len(_load.RULES)] for j in range(n_rules))
    return (f"You are the assistant of {TOPICS[i]}. You answer questions from visitors about its rules, prices "
            f"and services, briefly and politely, in one or two sentences. These are the rules. {rules} "
            f"If you do not know an answer, say so and suggest asking at the front desk.")


def systems(tok, lo: int = 400, hi: int = 600) -> list[str]:
    """The 8 system prompts, each 400-600 tokens (more rules, repeated, until it is)."""
    out = []
    for i in range(len(TOPICS)):
        n = 10
        while len(tok.encode(system_prompt(i, n))) < lo + (hi - lo) * i // (2 * len(TOPICS)):
            n += 1
        out.append(system_prompt(i, n))
        assert lo <= len(tok.encode(out[-1])) <= hi, len(tok.encode(out[-1]))
    return out


def trace(n_systems: int, per_system: int, seed: int = 0) -> list[tuple[int, int]]:
    pairs = [(s, q) for s in range(n_systems) for q in range(per_system)]
    return [pairs[i] for i in np.random.default_rng(seed).permutation(len(pairs))]


def ceiling(tok, prompts: list[str], order: list) -> float:
    """The trace's best hit rate, whatever the router and however large the pools: each request
    reads its longest common prefix with any request before it (the engine shares a page's
    leading tokens too; the chat template rendered as the server renders it)."""
    ids = [tok.apply_chat_template([dict(role="system", content=prompts[s]),
                                    dict(role="user", content=_load.question(s, q))],
                                   add_generation_prompt=True, tokenize=True).tolist() for s, q in order]

    def common(x, y):
        return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))

    cached = sum(max((common(x, y) for y in ids[:i]), default=0) for i, x in enumerate(ids))
    return cached / sum(len(x) for x in ids)


@dataclass
class Answer:
    ttft: float
    tokens: int
    prompt: int
    cached: int
    replica: str
    error: str = ""


def ask(cl, system: str, question: str, max_tokens: int, sampling: dict, seed: int) -> Answer:
    t0, first, usage, replica = time.perf_counter(), None, None, ""
    stream = cl.chat.completions.create(
        model="smollm2", messages=[dict(role="system", content=system), dict(role="user", content=question)],
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, seed=seed,
        extra_body=dict(ignore_eos=True), **sampling)
    for chunk in stream:
        usage = chunk.usage or usage
        replica = chunk.system_fingerprint or replica
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Answer(first if first is not None else float("nan"), usage.completion_tokens, usage.prompt_tokens,
                  cached or 0, replica)


def drive(url: str, prompts: list[str], order: list, clients: int, max_tokens: int, sampling: dict):
    """`clients` threads drain `order` ((system, question) pairs); (answers in order, wall s)."""
    out, nxt, lock = [None] * len(order), [0], threading.Lock()

    def body(c, cl):
        while True:
            with lock:
                i, nxt[0] = nxt[0], nxt[0] + 1
            if i >= len(order):
                return
            s, q = order[i]
            try:
                out[i] = ask(cl, prompts[s], _load.question(s, q), max_tokens, sampling, seed=i)
            except Exception as e:  # noqa: BLE001 - counted as the run's errors
                out[i] = Answer(float("nan"), 0, 0, 0, "", f"{type(e).__name__}: {e}")

    wall = _load.run_clients(url, clients, body)
    return out, wall


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:  # (503: warming)
        return json.load(e) if e.code == 503 else None
    except OSError:
        return None


def wait_ready(url: str, t0: float, timeout: float = 900) -> float:
    """Seconds from t0 until /health answers without `warming`."""
    while time.perf_counter() - t0 < timeout:
        h = health(url)
        if h is not None and not h.get("warming", True):
            return time.perf_counter() - t0
        time.sleep(0.25)
    raise SystemExit(f"{url} not ready in {timeout} s")


def rss_tree(pid: int) -> tuple[int, int]:
    """(processes, summed resident bytes) of pid's descendants (not pid itself)."""
    import psutil

    kids = psutil.Process(pid).children(recursive=True)
    total = 0
    for k in kids:
        try:
            total += k.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return len(kids), total


def pool_pages_for(model, max_batch: int, prompt_pages: int, tail_pages: int, rows: int,
                   keep: int = 5) -> tuple[int, int]:
    """(memory budget bytes, pool pages): the rows' state, `keep` system prompts' pages and the
    pages past their prompts of the `rows` a replica serves at once (the clients over the replicas)."""
    import tinyloop_jax as tl

    e = tl.Engine(model, max_batch=max_batch, memory_budget=None)
    try:
        loops = model.weights.config.default_loops
        pages = keep * prompt_pages + rows * tail_pages
        return e.budget.rows_nbytes() + pages * e.budget.page_nbytes(loops), pages
    finally:
        e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--routers", default="prefix,round_robin,power_of_two,oracle")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", default="16")
    ap.add_argument("--per-system", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--sampled", default="prefix,round_robin", help="routers also run sampled (temperature 0.8)")
    ap.add_argument("--no-single", action="store_true", help="skip one replica on one core")
    ap.add_argument("--no-startup", action="store_true", help="skip the single process's start-up and memory")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--imbalance", type=int, default=None, help="the prefix router's load bound (default: its own)")
    ap.add_argument("--ceiling", action="store_true", help="print the trace's ceiling hit rate and stop")
    args = ap.parse_args()

    import ray
    from ray import serve

    from tinyloop_jax import cli
    from tinyloop_jax.serving.app import eos_ids
    from tinyloop_jax.serving.ray_app import build_app

    load = functools.partial(cli.model_and_tokenizer_of, "smollm2")
    model, tok = load()
    prompts = systems(tok)
    lens = [len(tok.encode(p)) for p in prompts]
    prompt_pages = -(-max(lens) // 16) + 2  # (the template's tokens around it)
    tail_pages = -(-(40 + args.max_tokens) // 16) + 1
    clients = [int(c) for c in args.clients.split(",")]
    budget, pages = pool_pages_for(model, args.max_batch, prompt_pages, tail_pages, -(-max(clients) // args.replicas))
    order = trace(len(prompts), args.per_system)
    best = ceiling(tok, prompts, order)
    print(f"system prompts {min(lens)}-{max(lens)} tokens; {len(order)} requests; a replica's pool {pages} pages "
          f"({budget / 2**20:.0f} MiB); the trace's ceiling hit rate {100 * best:.1f}%", flush=True)
    if args.ceiling:
        return

    port = _load.free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options=dict(host="127.0.0.1", port=port))
    runs, starts, rss = [], {}, {}
    arms = [(r, args.replicas, "greedy") for r in args.routers.split(",")]
    arms += [(r, args.replicas, "t0.8") for r in args.sampled.split(",") if r]
    arms += [] if args.no_single else [("prefix", 1, "greedy")]
    try:
        for router, n, label in arms:  # (each a fresh deployment: empty caches)
            t0 = time.perf_counter()
            app = build_app(load, replicas=n, router=router, cores_per_replica=1, name="smollm2", max_loops=64,
                            eos=eos_ids("smollm2", tok, model.config()["vocab_size"]),
                            engine_kwargs=dict(max_batch=args.max_batch, memory_budget=budget),
                            router_kwargs=dict(capacity_pages=pages, **({} if args.imbalance is None else
                                                                         dict(imbalance=args.imbalance))), warmup={})
            serve.run(app, route_prefix="/", blocking=False)
            starts[n] = wait_ready(url, t0)
            print(f"{router} x{n}: ready in {starts[n]:.0f} s", flush=True)
            sampling = {} if label == "greedy" else dict(temperature=0.8)
            for c in clients:
                answers, wall = drive(url, prompts, order, c, args.max_tokens, sampling)
                runs.append(summary(router, n, label, c, answers, wall))
                print(line(runs[-1]), flush=True)
            procs, rss[n] = rss_tree(os.getpid())
            print(f"{router} x{n}: {procs} processes hold {rss[n] / 2**30:.2f} GiB", flush=True)
            serve.delete("default")
    finally:
        serve.shutdown()
        ray.shutdown()
    single = None if args.no_startup else single_process(budget, args.max_batch)
    if not args.no_write:
        report(args, runs, starts, rss, single, lens, pages, budget, best)


def summary(router, n, label, clients, answers, wall) -> dict:
    ok = [a for a in answers if not a.error]
    prompt, cached = sum(a.prompt for a in ok), sum(a.cached for a in ok)
    by = {}
    for a in ok:
        by[a.replica] = by.get(a.replica, 0) + 1
    ttft = [a.ttft for a in ok]
    return dict(router=router, replicas=n, sampling=label, clients=clients, hit=cached / max(1, prompt),
                prefill=prompt - cached, ttft50=_load.pct(ttft, 50), ttft99=_load.pct(ttft, 99),
                tps=sum(a.tokens for a in ok) / wall, split=sorted(by.values(), reverse=True),
                errors=len(answers) - len(ok), first_error=next((a.error for a in answers if a.error), ""))


def line(r: dict) -> str:
    return (f"{r['router']} x{r['replicas']} {r['sampling']} {r['clients']} clients: hit {100 * r['hit']:.1f}%, "
            f"prefill {r['prefill']} tokens, TTFT p50 {r['ttft50']:.2f} p99 {r['ttft99']:.2f} s, "
            f"{r['tps']:.1f} tok/s, split {r['split']}, errors {r['errors']} {r['first_error'][:200]}")


def single_process(budget: int, max_batch: int) -> tuple[float, float]:
    """(seconds to ready, peak RSS bytes) of one `tinyloop serve` process with a replica's engine
    (the compilation cache as warm as the replicas')."""
    port = _load.free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tinyloop_jax.cli", "serve", "--model", "smollm2", "--port",
                             str(port), "--log-level", "warning", "--max-batch", str(max_batch),
                             "--kv-memory", str(budget)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = wait_ready(f"http://127.0.0.1:{port}", t0)
        return ready, _load.peak_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def report(args, runs, starts, rss, single, lens, pages, budget, best) -> None:
    rows = ["| router | replicas | sampling | clients | hit rate | prefill tokens | TTFT p50 / p99 (s) | tok/s "
            "| requests per replica | errors |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r['router']} | {r['replicas']} | {r['sampling']} | {r['clients']} | {100 * r['hit']:.1f}% | "
             f"{r['prefill']:,} | {r['ttft50']:.2f} / {r['ttft99']:.2f} | {r['tps']:.1f} | "
             f"{' / '.join(map(str, r['split']))} | {r['errors']} |" for r in runs]
    body = "\n".join([
        *heading("Replicas on Ray Serve, routed by prefix (`scripts/bench_replicas.py`)"),
        f"{len(lens)} system prompts of {min(lens)}-{max(lens)} tokens x {args.per_system} questions, a fixed-seed "
        f"shuffle drained by the clients, {args.max_tokens} tokens an answer (`ignore_eos`, streamed); each run "
        f"a fresh deployment (empty caches), replicas pinned to a core each; each replica's pool {pages} pages "
        f"({budget / 2**20:.0f} MiB: 5 of the 8 prompts beside the pages past their prompts of the rows a "
        f"replica serves at {max(r['clients'] for r in runs)} clients over {args.replicas} replicas), the router told "
        f"the same capacity. Hit rate: cached / prompt tokens from the answers' usage; the trace's ceiling (each "
        f"request reading its longest common prefix with any request before it: any router, any pool) is "
        f"{100 * best:.1f}%.", "", *rows, "",
        "Start-up to ready (/health without `warming`, a warm compilation cache): "
        + ", ".join(f"{n} replica{'s' * (n > 1)} {s:.0f} s" for n, s in sorted(starts.items()))
        + (f"; one `tinyloop serve` process {single[0]:.0f} s" if single else "") + ".  ",
        "Resident memory of the Ray path after the load (every process the driver started: raylet, GCS, "
        "controller, proxy, ingress, replicas): "
        + ", ".join(f"{n} replica{'s' * (n > 1)} {b / 2**30:.2f} GiB" for n, b in sorted(rss.items()))
        + (f"; one `tinyloop serve` process (peak): {single[1] / 2**30:.2f} GiB." if single else "."), ""])
    print(write_section("Replicas on Ray Serve", body))


if __name__ == "__main__":
    main()
