"""Structured output's cost (issue 60): tokens/s of constrained decoding against free decoding on
SmolLM2 as served (Q4_1 kept packed), greedy and sampled (temperature 0.8), through `generate`
(batch 1: its loop on the device asking the host for each mask by callback, and the host's loop:
a token's forward and choice dispatched apart, the next masks filled while the forward runs) and
the engine (1 and 16 requests in flight), and the host's mask time per token.

The constraint is a regex that does not end within the tokens asked (`[a-z ,.]{1000}`) and a
JSON schema (an object of a bounded string, an enum and an integer: what users send; it ends
where the object does). Decode tokens/s = (tokens emitted - 1 a request) / (the time of the call
- the time of the same call with max_tokens 1): the prompt's prefill and the first token are not
counted, so answers of different lengths compare.

    python scripts/bench_structured.py [--repeats 3] [--no-write]
    python scripts/bench_structured.py --memory [--tree DIR]   # warmup's programs and peak RSS
    python scripts/bench_structured.py --profile                # where a constrained step's time goes

`--memory`: the server's engine (the bundled model, max_batch 16) warmed with and without
`grammar=True`, each in a fresh process with an empty compilation cache: programs compiled,
seconds, peak RSS (VmHWM). `--tree` runs another checkout's package (a `git worktree`: before
and after, back to back).

`--profile`: the engine at 16 in flight, one driver change at a time, in milliseconds a step
(16 rows, one token each): free decoding in bursts (several tokens a dispatch, the default),
free one token a dispatch, an `Unconstrained` grammar (every token allowed: the constrained
path's two dispatches a token and its reading, no llguidance work), then the regex and the
JSON schema; beside each, the host's llguidance time a step (masks filled, tokens taken) and
how often the device waited for the masks (the forward done before them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "kind": {"enum": ["capital", "port", "town"]},
                                           "population": {"type": "integer"}},
          "required": ["city", "kind", "population"], "additionalProperties": False}
FORMATS = {"free": None, "regex": {"type": "regex", "regex": "[a-z ,.]{1000}"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
MAX_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--tree", default=None)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if args.memory:
        return memory(args.tree)
    if args.profile:
        return profile(args.repeats, args.no_write)
    import _report
    import tinyloop_jax as tl
    from tinyloop_jax.decoding import grammar as G

    model, tok = tl.Model.from_pretrained("smollm2"), tl.load_tokenizer("smollm2")
    V = model.config()["vocab_size"]
    ids = tok.apply_chat_template([dict(role="user", content="Describe a large city in one line.")], tokenize=True)
    grammars = {k: None if f is None else tl.Grammar.of(f, tok, V) for k, f in FORMATS.items()}

    # the host's part: one mask filled per token (16 rows: one fill over 16 matchers)
    fill = {}
    for rows in (1, 16):
        ms = [grammars["json_schema"].matcher() for _ in range(rows)]
        t0 = time.perf_counter()
        for _ in range(50):
            G.fill_masks(ms, V)
        fill[rows] = (time.perf_counter() - t0) / 50 * 1e3
        print(f"host mask fill, json_schema at its start, {rows} rows: {fill[rows]:.3f} ms")

    rows_out = []

    def decode_rate(run) -> float:
        """run(max_tokens) -> tokens emitted (all requests); decode tokens/s past the first token."""
        run(MAX_TOKENS), run(1)
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter(); first = run(1); t1 = time.perf_counter()  # noqa: E702
            n = run(MAX_TOKENS)
            rates.append((n - first) / ((time.perf_counter() - t1) - (t1 - t0)))
        return statistics.median(rates)

    def gen_rate(kind: str, temperature: float) -> float:
        return decode_rate(lambda k: len(model.generate(ids, max_tokens=k, temperature=temperature, seed=1,
                                                        response_format=grammars[kind])) - len(ids))

    def engine_rate(eng, kind: str, temperature: float, clients: int, lengths=None) -> float:
        def run(k):  # (lengths: each row's own max_tokens, the JSON answers' lengths)
            hs = [eng.submit(ids, max_tokens=k if lengths is None else min(k, lengths[i]), temperature=temperature,
                             seed=i, response_format=grammars[kind]) for i in range(clients)]
            return sum(len(h.result()) - len(ids) for h in hs)
        return decode_rate(run)

    from tinyloop_jax.decoding import paged_decode

    for temperature in (0.0, 0.8):
        label = "greedy" if temperature == 0 else "t0.8"
        base = None
        for kind in FORMATS:
            for loop in ("device", "host") if kind != "free" else ("device",):
                paged_decode.GRAMMAR_LOOP = loop  # the loop on the device with a callback, or the host's (forward
                # and choice apart, the masks filled while the forward runs)
                r = gen_rate(kind, temperature)
                base = r if kind == "free" else base
                name = kind if kind == "free" else f"{kind} ({loop} loop)"
                print(f"generate batch 1, {name}, {label}: {r:.1f} tok/s")
                rows_out.append(f"| generate, batch 1 | {label} | {name} | {r:.1f} | {r / base:.2f}x |")
    paged_decode.GRAMMAR_LOOP = "host"
    with tl.Engine(model, max_batch=16) as eng:
        for clients in (1, 16):
            for temperature in (0.0, 0.8):
                label = "greedy" if temperature == 0 else "t0.8"
                base = None
                for kind in FORMATS:
                    r = engine_rate(eng, kind, temperature, clients)
                    if kind == "json_schema":  # its answers end with the object, each row at its own length: the
                        # free rows of the same lengths are its baseline (a batch drains alike)
                        lengths = answer_lengths(eng, ids, grammars[kind], temperature, clients)
                        base = engine_rate(eng, "free", temperature, clients, lengths)
                        print(f"engine {clients} in flight, free (JSON lengths), {label}: {base:.1f} tok/s")
                        rows_out.append(f"| engine, {clients} in flight | {label} | free, the JSON answers' lengths "
                                        f"| {base:.1f} | 1.00x |")
                    base = r if kind == "free" else base
                    print(f"engine {clients} in flight, {kind}, {label}: {r:.1f} tok/s")
                    rows_out.append(f"| engine, {clients} in flight | {label} | {kind} | {r:.1f} | {r / base:.2f}x |")
    if args.no_write:
        return
    body = "\n".join([
        *_report.heading("Structured output's cost (issue 60, `scripts/bench_structured.py`)"),
        f"SmolLM2-135M-Instruct (Q4_1 kept packed), a chat prompt of {len(ids)} tokens, up to {MAX_TOKENS} tokens; "
        f"medians of {args.repeats}; decode tokens/s past each request's first token (the call's time less the "
        "same call's with max_tokens 1). `regex` is `[a-z ,.]{1000}` (never done within the tokens asked), "
        "`json_schema` ends with its object. Host mask fill (llguidance, the schema at its "
        f"start): {fill[1]:.3f} ms for 1 row, {fill[16]:.3f} ms for 16.", "",
        "| driver | sampling | format | tok/s | / free |", "|---|---|---|---|---|", *rows_out, ""])
    _report.write_section("bench_structured", body)


def answer_lengths(eng, ids, grammar, temperature: float, clients: int) -> list[int]:
    """Each row's answer length (seed i) under `grammar` at MAX_TOKENS."""
    hs = [eng.submit(ids, max_tokens=MAX_TOKENS, temperature=temperature, seed=i, response_format=grammar)
          for i in range(clients)]
    return [len(h.result()) - len(ids) for h in hs]


WARM = """
import os, sys, tempfile, time
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tinyloop-xla-")
from tinyloop_jax.cli import _load, persistent_compile_cache
from tinyloop_jax.serving.engine import Engine
persistent_compile_cache()
eng = Engine(_load(None, None), max_batch=16)
t0 = time.perf_counter()
n = eng.warmup(grammar=sys.argv[1] == "1")
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(n, time.perf_counter() - t0, hwm / 2**20)
"""


def profile(repeats: int, no_write: bool) -> None:
    """Where a constrained step's time goes (see the docstring): ms a 16-row step, medians."""
    import collections

    import _report
    import tinyloop_jax as tl
    from tinyloop_jax.decoding import grammar as G
    from tinyloop_jax.serving import reading
    from tinyloop_jax.serving.batcher import Batcher

    class Anything:  # a matcher that allows every token and never ends
        def consume_token(self, t):
            return True

        def is_stopped(self):
            return False

        def get_error(self):
            return ""

    class Unconstrained(G.Grammar):
        def matcher(self):
            return Anything()

    host = collections.Counter()

    def timed(name, f):
        def g(*a):
            t0 = time.perf_counter()
            try:
                return f(*a)
            finally:
                host[name] += time.perf_counter() - t0
        return g

    fill = G.fill_masks
    G.fill_masks = timed("fill", lambda ms, V: fill([None if isinstance(m, Anything) else m for m in ms], V))
    reading.take = timed("take", reading.take)
    waits = collections.Counter()  # the device's idle gap: was the forward done before the masks?
    run_program = Batcher._run

    def watched(self, key, program, *args, **kw):
        if key[0] == "choose":  # (its last argument: the forward's logits)
            waits["steps"] += 1
            waits["idle"] += bool(args[-1].is_ready())
        return run_program(self, key, program, *args, **kw)
    Batcher._run = watched
    model, tok = tl.Model.from_pretrained("smollm2"), tl.load_tokenizer("smollm2")
    V = model.config()["vocab_size"]
    ids = tok.apply_chat_template([dict(role="user", content="Describe a large city in one line.")], tokenize=True)
    grammars = dict(unconstrained=Unconstrained("unconstrained", "", None, V),
                    **{k: tl.Grammar.of(f, tok, V) for k, f in FORMATS.items() if f is not None})
    rows = ["| sampling | driver | ms per 16 tokens | / free in bursts | host llguidance ms | device idle |",
            "|---|---|---|---|---|---|"]
    engines = {n: tl.Engine(model, max_batch=16, decode_steps=n) for n in (4, 1)}
    try:
        for temperature in (0.0, 0.8):
            label = "greedy" if temperature == 0 else "t0.8"
            lengths = answer_lengths(engines[4], ids, grammars["json_schema"], temperature, 16)
            arms = [("free, bursts of 4", 4, None, None), ("free, 1 token a dispatch", 1, None, None)]
            arms += [(f"{k}", 4, g, None) for k, g in grammars.items()]
            arms.insert(-1, ("free, the JSON answers' lengths", 4, None, lengths))

            def run(arm, k):
                _, n, g, cut = arm
                hs = [engines[n].submit(ids, max_tokens=k if cut is None else min(k, cut[i]),
                                        temperature=temperature, seed=i, response_format=g) for i in range(16)]
                return sum(len(h.result()) - len(ids) for h in hs)
            for arm in arms:
                run(arm, MAX_TOKENS), run(arm, 1)
            per, spent, idle = ({a[0]: [] for a in arms} for _ in range(3))
            for _ in range(repeats):  # (the arms in turn, a round at a time: the machine's drift shared)
                for arm in arms:
                    t0 = time.perf_counter(); first = run(arm, 1); t1 = time.perf_counter()  # noqa: E702
                    host.clear(), waits.clear()
                    n_tok = run(arm, MAX_TOKENS)
                    idle[arm[0]].append(waits["idle"] / max(1, waits["steps"]))
                    steps = (n_tok - first) / 16
                    per[arm[0]].append(((time.perf_counter() - t1) - (t1 - t0)) / steps * 1e3)
                    spent[arm[0]].append(sum(host.values()) / steps * 1e3)
            base = statistics.median(per[arms[0][0]])
            for name, *_ in arms:
                ms, hms, gap = (statistics.median(x[name]) for x in (per, spent, idle))
                gap = f"{100 * gap:.0f}%" if name in grammars else ""
                print(f"{label} {name}: {ms:.2f} ms ({base / ms:.2f}x), llguidance {hms:.2f} ms, idle {gap}")
                rows.append(f"| {label} | {name} | {ms:.2f} | {base / ms:.2f}x | {hms:.2f} | {gap} |")
    finally:
        for e in engines.values():
            e.close()
    if not no_write:
        _report.write_section("bench_structured_profile", "\n".join([
            *_report.heading("Where a constrained step's time goes (`scripts/bench_structured.py --profile`)"),
            f"SmolLM2 (Q4_1 kept packed), the engine, 16 requests in flight of up to {MAX_TOKENS} tokens, a step = "
            f"16 tokens (one a row), medians of {repeats} rounds (the arms in turn); the time of 16 tokens is the "
            "call's less the same call's with max_tokens 1, over the tokens past the first, times 16. "
            "`unconstrained`: a grammar allowing every token (the constrained driver without llguidance's work). "
            "Host llguidance: masks filled and tokens taken, per 16 tokens. Device idle: the share of constrained "
            "steps whose forward had finished when their masks were ready (the device waited on the host).", "",
            *rows, ""]))


def memory(tree: str | None) -> None:
    """Warmup with and without the grammar programs, each in a fresh process (see the docstring)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) if tree else os.getcwd())
    for grammar in (0, 1):
        out = subprocess.run([sys.executable, "-c", WARM, str(grammar)], env=env, capture_output=True, text=True,
                             check=True).stdout.split()
        n, secs, gib = int(out[0]), float(out[1]), float(out[2])
        print(f"{tree or 'this tree'}: warmup(grammar={bool(grammar)}): {n} programs, {secs:.1f} s, "
              f"peak RSS {gib:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
