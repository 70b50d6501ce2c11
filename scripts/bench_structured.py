"""Structured output's cost (issue 60): tokens/s of constrained decoding against free decoding on
SmolLM2 as served (Q4_1 kept packed), greedy and sampled (temperature 0.8), through `generate`
(batch 1) and the engine (1 and 16 requests in flight), and the host's mask time per token.

The constraint is a regex that never ends early (`[a-z ,.]{64}`: every request emits its 64
tokens, so both arms decode the same count) and a JSON schema (an object of a bounded string, an
enum and an integer: what users send; it ends where the object does, so its tokens/s counts the
tokens it emitted).

    python scripts/bench_structured.py [--repeats 3] [--no-write]
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
FORMATS = {"free": None, "regex": {"type": "regex", "regex": "[a-z ,.]{64}"},
           "json_schema": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
MAX_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
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

    def gen_rate(kind: str, temperature: float) -> float:
        n = 0

        def run():
            nonlocal n
            out = model.generate(ids, max_tokens=MAX_TOKENS, temperature=temperature, seed=1,
                                 response_format=grammars[kind])
            n = len(out) - len(ids)
        run()
        times = [_timed(run) for _ in range(args.repeats)]
        return n / statistics.median(times)

    def engine_rate(eng, kind: str, temperature: float, clients: int) -> float:
        def run():
            hs = [eng.submit(ids, max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
                             response_format=grammars[kind]) for i in range(clients)]
            return sum(len(h.result()) - len(ids) for h in hs)
        run()
        rates = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            n = run()
            rates.append(n / (time.perf_counter() - t0))
        return statistics.median(rates)

    for temperature in (0.0, 0.8):
        label = "greedy" if temperature == 0 else "t0.8"
        base = None
        for kind in FORMATS:
            r = gen_rate(kind, temperature)
            base = r if kind == "free" else base
            print(f"generate batch 1, {kind}, {label}: {r:.1f} tok/s")
            rows_out.append(f"| generate, batch 1 | {label} | {kind} | {r:.1f} | {r / base:.2f}x |")
    with tl.Engine(model, max_batch=16) as eng:
        for clients in (1, 16):
            for temperature in (0.0, 0.8):
                label = "greedy" if temperature == 0 else "t0.8"
                base = None
                for kind in FORMATS:
                    r = engine_rate(eng, kind, temperature, clients)
                    base = r if kind == "free" else base
                    print(f"engine {clients} in flight, {kind}, {label}: {r:.1f} tok/s")
                    rows_out.append(f"| engine, {clients} in flight | {label} | {kind} | {r:.1f} | {r / base:.2f}x |")
    if args.no_write:
        return
    body = "\n".join([
        "## Structured output's cost (issue 60, `scripts/bench_structured.py`)", "",
        f"Command: `{_report.command()}`  ", f"Machine: {_report.machine()}", "",
        f"SmolLM2-135M-Instruct (Q4_1 kept packed), a chat prompt of {len(ids)} tokens, up to {MAX_TOKENS} tokens; "
        f"medians of {args.repeats}. `regex` emits all {MAX_TOKENS} tokens (`[a-z ,.]{{64}}`), `json_schema` ends "
        "with its object (tokens/s over the tokens it emitted). Host mask fill (llguidance, the schema at its "
        f"start): {fill[1]:.3f} ms for 1 row, {fill[16]:.3f} ms for 16.", "",
        "| driver | sampling | format | tok/s | / free |", "|---|---|---|---|---|", *rows_out, ""])
    _report.write_section("bench_structured", body)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
