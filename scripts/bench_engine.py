"""The engine on pages (issue 45) on SmolLM2-135M-Instruct as shipped: one served client against
`Model.generate` on the same prompt, and a decode step's time against rows x live tokens for the
engine before pages and the engine on pages.

    python scripts/bench_engine.py              # ~15 min on 2 CPUs; writes docs/benchmarks.md
    python scripts/bench_engine.py --no-write --skip-steps

1. Decode tokens/s, one client, greedy, 64 tokens after a ~350-token chat prompt (a ~330-token
   system prompt and a question): `Model.generate` (batch 1: (t(65 tokens) - t(1 token)) / 64),
   the engine in process (`Engine.submit`, streamed: the gaps between tokens) and over HTTP
   (`tinyloop serve`'s app, the official openai client streaming a chat completion). Medians of
   --repeats runs after a warm-up run of each.
2. A decode step's time (median of --steps) for B rows (1, 4, 16) of L live tokens each (64, 512,
   2048): the paged step with the native attention kernel and with the XLA reference. The engine
   before pages (its lanes' `decode_step`) was measured beside it by this script at commit
   5f03f68, the last that had it; docs/benchmarks-history.md keeps that table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402

import tinyloop_jax as tl  # noqa: E402
from _report import command, machine, write_section  # noqa: E402

SYSTEM = ("You are the assistant of a public library. You answer questions about opening hours, membership, "
          "borrowing rules, the catalogue, events and the reading rooms. Membership is free for residents and "
          "costs twelve euros a year for visitors. Members may borrow up to ten books, four films and two games "
          "at a time, for three weeks, renewable twice unless someone else has reserved the item. Late returns "
          "cost twenty cents a day per item, capped at five euros. The main building opens from nine to seven on "
          "weekdays and from ten to five on Saturdays; it is closed on Sundays and public holidays. The children's "
          "room has story hours on Wednesday afternoons and a homework club on Thursdays. The reading rooms are "
          "quiet zones: no phone calls, no food, drinks only in closed bottles. Laptops are welcome and the "
          "wireless network is open to everyone. Printing costs ten cents a page in black and white and fifty in "
          "colour. Lost cards are replaced for two euros. Answer briefly and politely, in one or two sentences, "
          "and say when you do not know. The library also lends museum passes, two at a time for one week, and "
          "laptops for use inside the building only, against an identity card. Group visits for schools are "
          "booked by email at least two weeks ahead. The garden behind the main building is open in summer; "
          "readers may take books there but not films or games. The basement holds the local archive, open "
          "on Tuesday and Friday mornings by appointment.")
QUESTION = "Can I borrow five films at once, and what happens if I return one late?"


def generate_decode_rate(model, ids, n: int, repeats: int) -> float:
    """Model.generate's decode tokens/s at batch 1: n more tokens after the first."""
    run = lambda k: model.generate(ids, max_tokens=k, stop_sequences=[])  # noqa: E731
    run(n + 1)
    run(1)
    longs, shorts = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        run(n + 1)
        longs.append(time.perf_counter() - t)
        t = time.perf_counter()
        run(1)
        shorts.append(time.perf_counter() - t)
    return n / (statistics.median(longs) - statistics.median(shorts))


def stream_rate(times: list[float]) -> float:
    """Tokens/s from the arrival times of a stream's tokens (the first one excluded: prefill)."""
    return (len(times) - 1) / (times[-1] - times[0])


def engine_decode_rate(engine, ids, n: int, repeats: int) -> tuple[float, float]:
    """(decode tokens/s, TTFT s): medians over runs of one request streamed from the engine."""
    rates, ttfts = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        h = engine.submit(ids, max_tokens=n + 1)
        times = []
        for _ in h.stream():
            times.append(time.perf_counter())
        if i:  # the first run warms the prompt's pages
            rates.append(stream_rate(times))
            ttfts.append(times[0] - t0)
    return statistics.median(rates), statistics.median(ttfts)


def http_decode_rate(model, tok, messages, n: int, repeats: int) -> tuple[float, float]:
    """(decode tokens/s, TTFT s) of one chat completion streamed over HTTP (openai client)."""
    import openai
    import uvicorn

    from tinyloop_jax.serving.app import eos_ids, make_app
    engine = tl.Engine(model)
    app = make_app(engine, tok, "smollm2", eos=eos_ids(None, tok, model.config()["vocab_size"]))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    rates, ttfts = [], []
    try:
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            times = []
            stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=n + 1,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    times.append(time.perf_counter())
            if i:  # a chunk carries the tokens that came together (a burst of `decode_steps`): the
                # rate counts tokens, n + 1 of them (ignore_eos), the first alone in its chunk (the prefill's)
                rates.append(n / (times[-1] - times[0]))
                ttfts.append(times[0] - t0)
    finally:
        server.should_exit = True
        thread.join()
        engine.close()
    return statistics.median(rates), statistics.median(ttfts)


# ---- step time: rows x live tokens -------------------------------------------------------------

def paged_step_time(model, rows: int, live: int, steps: int) -> float:
    """The paged engine's step for `rows` decode rows of `live` tokens each, pages of their own."""
    from tinyloop_jax.model import page_pool
    from tinyloop_jax.serving import step as S
    from tinyloop_jax.decoding import compiled, step as St
    from tinyloop_jax.serving.plan import MIN_TABLE, batch_buckets, pow2
    c, P = model.weights.config, page_pool.PAGE_SIZE
    loops = c.default_loops
    per_row = -(-(live + steps + 2) // P)
    pool = jax.jit(lambda: page_pool.empty(c, loops, rows * per_row, P))()
    state = St.empty_rows(16, c.vocab_size, c.d_model, c.compute_dtype)
    program = compiled.programs().step
    bd = next(b for b in batch_buckets(16) if b >= rows)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    times = []
    for i in range(steps + 2):
        length = live + i
        R = pow2(-(-(length + 1) // P), MIN_TABLE)
        dec = S.make_decodes(tables, [length] * rows, list(range(rows)), [1] * rows, R, bd)
        t = time.perf_counter()
        _, tok, pool, state = program(model.weights.params, c, pool, state, None, dec, loops=loops,
                                      exit=model.exit_for(loops))
        jax.block_until_ready(tok)
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--live", default="64,512,2048")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--activations", default="float32", choices=["float32", "int8"],
                    help="what the packed weights multiply (`Model`'s activations)")
    args = ap.parse_args()
    model = tl.Model.from_pretrained("smollm2", activations=args.activations)
    tok = tl.load_tokenizer("smollm2")
    messages = [dict(role="system", content=SYSTEM), dict(role="user", content=QUESTION)]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True).tolist()
    n = args.tokens
    print(f"prompt: {len(ids)} tokens; {n} decode tokens", flush=True)
    gen = generate_decode_rate(model, ids, n, args.repeats)
    print(f"Model.generate: {gen:.1f} tok/s", flush=True)
    with tl.Engine(model) as eng:
        eng_rate, eng_ttft = engine_decode_rate(eng, ids, n, args.repeats)
    print(f"Engine, in process: {eng_rate:.1f} tok/s ({eng_rate / gen:.0%}), TTFT {eng_ttft:.3f} s", flush=True)
    http_rate, http_ttft = http_decode_rate(model, tok, messages, n, args.repeats)
    print(f"Engine over HTTP: {http_rate:.1f} tok/s ({http_rate / gen:.0%}), TTFT {http_ttft:.3f} s", flush=True)
    lines = [f"SmolLM2-135M-Instruct as shipped (Q4_1 kept packed, kv_mode {model.config()['kv_mode']}), a "
             f"{len(ids)}-token chat prompt, {n} decode tokens after the first, greedy; medians of "
             f"{args.repeats} runs after a warm-up run. {machine()}.", "",
             "| one client | decode tok/s | share of `Model.generate` | TTFT (warm prompt pages) |",
             "|---|---|---|---|",
             f"| `Model.generate`, batch 1 | {gen:.1f} | 100% | |",
             f"| `Engine.submit`, streamed | {eng_rate:.1f} | {eng_rate / gen:.0%} | {eng_ttft:.3f} s |",
             f"| HTTP chat completion, openai client streaming | {http_rate:.1f} | {http_rate / gen:.0%} | "
             f"{http_ttft:.3f} s |"]
    if not args.skip_steps:
        rows, lives = [int(x) for x in args.rows.split(",")], [int(x) for x in args.live.split(",")]
        lines += ["", f"A decode step's time, ms (median of {args.steps} steps): B rows of L live tokens each; "
                  "attention by the native kernel (each row's live pages) and by the XLA reference (a gather of "
                  "each row's page table, `TINYLOOP_PAGED_KERNEL=0`), back to back.", "",
                  "| B | L | native kernel | XLA reference | reference / kernel |", "|---|---|---|---|---|"]
        for b in rows:
            for live in lives:
                times = {}
                for arm in ("1", "0"):
                    os.environ["TINYLOOP_PAGED_KERNEL"] = arm
                    jax.clear_caches()
                    times[arm] = paged_step_time(model, b, live, args.steps)
                os.environ.pop("TINYLOOP_PAGED_KERNEL")
                jax.clear_caches()
                k, r = times["1"], times["0"]
                print(f"B={b} L={live}: kernel {k * 1e3:.1f} ms, reference {r * 1e3:.1f} ms", flush=True)
                lines.append(f"| {b} | {live} | {k * 1e3:.1f} | {r * 1e3:.1f} | {r / k:.2f}x |")
    body = "\n".join(["## The engine on pages (issue 45, `scripts/bench_engine.py`)", "", f"`{command()}`", ""]
                     + lines)
    print(body)
    if not args.no_write:
        write_section("bench_engine", body)


if __name__ == "__main__":
    main()
