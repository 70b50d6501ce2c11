"""Load test of `tinyloop serve` on localhost: N concurrent streaming clients, Zipf over 8 system
prompts + unique questions, and now and then a long prompt with no cached prefix.

Arms (the same requests, in the same process, one after another):
  engine     Engine(max_batch=16) with prefix sharing by pages (the server as shipped)
  sync       the same engine reading each decode step's tokens before dispatching the next
             (overlap=False: the loop before issue 22)
  batch1     the same server with max_batch=1 (one request at a time, still prefix-cached)
  nostore    max_batch=16, no prefix sharing (every prompt prefilled whole)

Reported per arm: throughput (emitted tokens / wall time), time to first token (TTFT) p50/p99
for the short (system-prompt) requests and for the long ones, the gaps between a stream's
tokens (inter-token latency) p50/p99, request latency p50/p99, and
whether every greedy output equals the engine arm's, and wall ms per decode step against the
decode program's own time (`step_floor`). Each arm first serves one request per
system prompt (untimed: compiles, and the pool holds the hot prompts' pages, as in steady state).
The clients are `_load.py`'s (`drain`: the openai client streaming completions of token ids,
greedy, `ignore_eos`), in this process beside the server.

    python scripts/bench_serve.py                       # bundled model and a GPT-2-small shape
    python scripts/bench_serve.py --models bundled --requests 48
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _load  # noqa: E402
from _report import command, machine, write_section  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from tinyloop_jax.cli import BUNDLED  # noqa: E402
from tinyloop_jax.data import pydoc_bytes  # noqa: E402


class IdsTokenizer:
    """Text for a model without a tokenizer (the random GPT-2 shape): ids as words."""

    def encode(self, text: str, special: bool = True) -> np.ndarray:
        return np.array([int(t) for t in text.split()], np.int32)

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)


def workload(name: str, model, n: int, rng) -> list[list[int]]:
    """n prompts: Zipf(1) over 8 system prompts + a unique question; every 8th a long unique
    prompt. The bundled model has a 256-byte context, so its system prompts are 96-160 bytes
    of pydoc text (the GPT-2 shape's 256-512 tokens)."""
    c = model.weights.config
    if name == "bundled":
        text = np.frombuffer(pydoc_bytes(), np.uint8).astype(np.int32)
        starts = rng.integers(0, len(text) - 1000, 9)
        systems = [text[s:s + int(rng.integers(96, 161))] for s in starts[:8]]
        question = lambda: text[(q := int(rng.integers(0, len(text) - 40))):q + int(rng.integers(16, 33))]  # noqa
        long = lambda: text[(q := int(rng.integers(0, len(text) - 300))):q + 200]  # noqa: E731
    else:
        systems = [rng.integers(0, c.vocab_size, int(rng.integers(256, 513))) for _ in range(8)]
        question = lambda: rng.integers(0, c.vocab_size, int(rng.integers(16, 33)))  # noqa: E731
        long = lambda: rng.integers(0, c.vocab_size, 480)  # noqa: E731
    zipf = 1.0 / np.arange(1, 9)
    zipf /= zipf.sum()
    out = []
    for i in range(n):
        if i % 8 == 7:
            out.append(long().tolist())
        else:
            out.append(np.concatenate([systems[rng.choice(8, p=zipf)], question()]).tolist())
    warm = [np.concatenate([s, question()]).tolist() for s in systems] + [long().tolist()]
    return out, warm


class Server:
    def __init__(self, model, tokenizer, **engine_kw):
        import uvicorn

        from tinyloop_jax.serving.app import make_app

        self.engine = tl.Engine(model, **engine_kw)
        t = time.perf_counter()
        self.engine.warmup()
        self.warmup_s = time.perf_counter() - t
        self.server = uvicorn.Server(uvicorn.Config(make_app(self.engine, tokenizer, "bench"), host="127.0.0.1",
                                                    port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def close(self):
        self.server.should_exit = True
        self.thread.join()
        self.engine.close()


def load(port: int, prompts: list, max_tokens: int, clients: int) -> tuple[list, float]:
    """`clients` streaming clients (`_load.drain`) take the next prompt (token ids, a greedy
    completion, `ignore_eos`) until none is left. Returns (results in the prompts' order, wall s)."""
    ld = _load.drain(f"http://127.0.0.1:{port}", _load.Workload(model="bench", max_tokens=max_tokens, chat=False),
                     prompts, clients)
    return ld.results, ld.wall


def pct(xs, q) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


ARMS = dict(engine=dict(max_batch=16), sync=dict(max_batch=16, overlap=False), batch1=dict(max_batch=1),
            nostore=dict(max_batch=16, prefix_cache=False))


def step_floor(model, kw, rows: int = 16, n: int = 48, live: int = 64) -> tuple[float, float]:
    """The engine's step program alone on `rows` decode rows of `live` tokens each: ms per step
    dispatched back to back (the device's time: no host work between steps), and ms per step
    when each step's tokens are read before the next."""
    from tinyloop_jax.model import page_pool
    from tinyloop_jax.serving import step as S
    from tinyloop_jax.decoding import compiled, step as St
    from tinyloop_jax.serving.plan import MIN_TABLE, pow2

    c, P = model.weights.config, page_pool.PAGE_SIZE
    loops = c.default_loops
    per_row = -(-(live + 2 * n + 4) // P)
    out = []
    for sync in (False, True):
        pool = jax.jit(lambda: page_pool.empty(c, loops, rows * per_row, P))()
        state = St.empty_rows(rows, c.vocab_size, c.d_model, c.compute_dtype)
        program = compiled.programs().step
        tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
        R = pow2(per_row, MIN_TABLE)
        dec = S.make_decodes(tables, [live] * rows, list(range(rows)), [1] * rows, R, rows)
        _, tok, pool, state = program(model.weights.params, c, pool, state, None, dec, loops=loops,
                                      exit=model.exit_for(loops))
        np.asarray(tok.tokens)  # compiled, warm
        t = time.perf_counter()
        for _ in range(n):
            _, tok, pool, state = program(model.weights.params, c, pool, state, None, dec, loops=loops,
                                          exit=model.exit_for(loops))
            if sync:
                np.asarray(tok.tokens)
        np.asarray(tok.tokens)
        out.append((time.perf_counter() - t) / n * 1e3)
    return out[0], out[1]


def run_model(name: str, args) -> str:
    if name == "bundled":
        model, tok = tl.Model.load(BUNDLED), tl.ByteTokenizer()
        extra = {}
    else:  # GPT-2 small's shape (random weights): 12 layers of d 768, vocabulary 50257
        cfg = tl.ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_pre_blocks=11, default_loops=1,
                             max_seq_len=1024)
        model, tok = tl.Model.random(cfg, seed=0), IdsTokenizer()
        extra = {}
    c = model.weights.config
    rng = np.random.default_rng(0)
    n = args.requests if name == "bundled" else args.gpt2_requests
    prompts, warm = workload(name, model, n, rng)
    rows, ref = [], None
    for arm in (args.arms if name == "bundled" else args.gpt2_arms):
        kw = dict(ARMS[arm], **extra)
        print(f"[{name}] {arm}: {kw}", file=sys.stderr, flush=True)
        srv = Server(model, tok, **kw)
        try:
            load(srv.port, warm, args.max_tokens, 1)
            before = srv.engine.stats()
            results, wall = load(srv.port, prompts, args.max_tokens, args.clients)
            after = srv.engine.stats()
            stats = {k: after.get(k, 0) - before.get(k, 0) for k in ("decode_steps", "batch_rows",
                                                                      "requests_prefix_hit", "requests",
                                                                      "compiles_after_warmup")}
        finally:
            srv.close()
        tokens = sum(len(r.ids) for r in results)
        short = [r for i, r in enumerate(results) if i % 8 != 7]
        long_ = [r for i, r in enumerate(results) if i % 8 == 7]
        ids = [r.ids for r in results]
        same = "reference" if ref is None else ("yes" if ids == ref else
                                                f"NO ({sum(a != b for a, b in zip(ids, ref))} differ)")
        ref = ids if ref is None else ref
        rows.append(dict(arm=arm, tps=tokens / wall, wall=wall, tokens=tokens,
                         ttft50=pct([r.ttft for r in short], 50), ttft99=pct([r.ttft for r in short], 99),
                         lttft50=pct([r.ttft for r in long_], 50), lttft99=pct([r.ttft for r in long_], 99),
                         lat50=pct([r.latency for r in results], 50), lat99=pct([r.latency for r in results], 99),
                         itl50=pct(sum((r.itl for r in results), []), 50),
                         itl99=pct(sum((r.itl for r in results), []), 99),
                         batch=stats["batch_rows"] / max(stats["decode_steps"], 1),
                         hit=stats["requests_prefix_hit"] / max(stats["requests"], 1), same=same,
                         compiles=after.get("compiles_after_warmup", 0), warmup=srv.warmup_s,
                         step=wall / max(stats["decode_steps"], 1) * 1e3))
        r = rows[-1]
        print(f"  {r['tps']:.1f} tok/s, ttft p50 {r['ttft50']:.3f} p99 {r['ttft99']:.3f} s, "
              f"itl p99 {r['itl99'] * 1e3:.0f} ms, batch {r['batch']:.1f}, {r['step']:.1f} ms/step, "
              f"same {same}", file=sys.stderr, flush=True)
    floor, synced = step_floor(model, dict(ARMS["engine"], **extra))
    base = next((r for r in rows if r["arm"] == "batch1"), None)
    lines = [f"**{name}** (loops={c.default_loops}, context {c.max_seq_len}, {n} requests, "
             f"{args.clients} clients, max_tokens {args.max_tokens}"
             + (f", {extra}" if extra else "") + ")", "",
             "| arm | tok/s | vs batch1 | TTFT p50 / p99 (s), system-prompt requests | TTFT p50 / p99 (s), "
             "long prompts | inter-token p50 / p99 (ms) | latency p50 / p99 (s) | mean batch | prefix hits | "
             "greedy == engine | compiles after warmup (warmup s) | wall ms per decode step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tps'] / base['tps']:.2f}x" if base else "-"
        lines.append(f"| {r['arm']} | {r['tps']:.1f} | {ratio} | {r['ttft50']:.3f} / {r['ttft99']:.3f} | "
                     f"{r['lttft50']:.3f} / {r['lttft99']:.3f} | {r['itl50'] * 1e3:.0f} / {r['itl99'] * 1e3:.0f} | "
                     f"{r['lat50']:.2f} / {r['lat99']:.2f} | "
                     f"{r['batch']:.1f} | {r['hit']:.0%} | {r['same']} | {r['compiles']} ({r['warmup']:.0f}) | "
                     f"{r['step']:.1f} |")
    lines += ["", f"The engine's 16-row decode program alone (every pool slot read): {floor:.1f} ms a step dispatched "
              f"back to back (the device's time), {synced:.1f} ms when each step's tokens are read before the next "
              "is dispatched. 'wall ms per decode step' is the arm's wall time over its decode steps (prompt "
              "chunks run between them)."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bundled,gpt2-small")
    ap.add_argument("--arms", default="engine,batch1,nostore")
    ap.add_argument("--requests", type=int, default=96, help="requests per arm, bundled model")
    ap.add_argument("--gpt2-requests", type=int, default=32, help="requests per arm, GPT-2 shape")
    ap.add_argument("--gpt2-arms", default="engine,batch1,nostore")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.arms, args.gpt2_arms = args.arms.split(","), args.gpt2_arms.split(",")
    sections = [run_model(m, args) for m in args.models.split(",")]
    body = "\n\n".join(["## Serving: continuous batching over the prefix store (issue 15)\n",
                        f"`{command()}` on {machine()}.\n", *sections])
    print(body)
    if not args.no_write:
        print("wrote", write_section("bench_serve", body))


if __name__ == "__main__":
    main()
