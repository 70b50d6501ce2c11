"""`Model.generate` and the prefix-cache calls on SmolLM2-135M-Instruct as shipped: the numbers
that must not get worse when the `Model` path moves onto another implementation (issue 45: the
paged step under an on-device loop). Run it in two trees back to back to compare:

    python scripts/bench_generate.py --no-write                  # this tree
    PYTHONPATH=/path/to/other/tree python scripts/bench_generate.py --no-write --label before

Rows (medians of --repeats after a warm-up call of each):
  generate, batch 1       decode tok/s: 64 tokens after a ~350-token chat prompt, as
                          (t(65 tokens) - t(1 token)) / 64 (the prefill cancels out)
  from prefix, 4 rows     tokens/s of generate_batch_from_prefix_cache: 4 questions after a kept
                          ~330-token system prompt, 32 tokens each
  speculative             tokens/s of generate(draft_loops=) on the bundled looped model
  conversation            tokens/s of a 4-turn `Conversation` on SmolLM2 (answers streamed; wall
                          time of the whole chat, prefills included)
  prefix build            ms of build_prefix_cache on SmolLM2 at 100 / 300 / 1,000 random tokens (and
                          at 300 with keep_state), and
                          of extending a 900-token prefix to 1,000 (`functional.extend_prefix`, a
                          PrefixStore's hit); `--prefixes-only` runs these rows alone
  scoring                 ms of Model.score at 100 / 300 / 1,000 random tokens (its first call,
                          compiles included, and top_logprobs=5 at 300) and of held-out bits per
                          byte over 8 windows of 256 tokens (`evaluate.bits_per_byte`);
                          `--scores-only` runs these rows alone
  kv modes                decode tok/s of generate_from_prefix_cache per KV mode on a random looped
                          model (D 384, 2 pre blocks, loops 8, a 1024-token prefix;
                          `bench_kv_modes.decode_speed`)
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tinyloop_jax as tl  # noqa: E402
from _report import command, machine, median_time, write_section  # noqa: E402
from bench_engine import QUESTION, SYSTEM, generate_decode_rate  # noqa: E402
BUNDLED = os.path.join(os.path.dirname(HERE), "checkpoints", "tinyloop-pydoc")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--modes", default="fp32,fp16,int8,int4,fp16-h,int4-h")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--activations", default="float32", choices=["float32", "int8"],
                    help="what the packed weights multiply (`Model`'s activations)")
    ap.add_argument("--prefixes-only", action="store_true", help="only the prefix-build rows")
    ap.add_argument("--scores-only", action="store_true", help="only the scoring rows")
    args = ap.parse_args()
    model = tl.Model.from_pretrained("smollm2", activations=args.activations)
    if args.prefixes_only:
        return report(args, prefix_rows(model, args.repeats))
    if args.scores_only:
        return report(args, score_rows(model, args.repeats))
    tok = tl.load_tokenizer("smollm2")
    chat = lambda q: tok.apply_chat_template([dict(role="system", content=SYSTEM),  # noqa: E731
                                               dict(role="user", content=q)], tokenize=True,
                                              add_generation_prompt=True).tolist()
    rows = [("generate, batch 1: decode tok/s", generate_decode_rate(model, chat(QUESTION), 64, args.repeats))]
    asks = [chat(q) for q in ("When do you open on Sunday?", "How much is a late film?", "Can I renew a game?",
                              "Where is the reading room?")]
    k = next(i for i in range(min(map(len, asks))) if len({a[i] for a in asks}) > 1)  # the shared head
    prefix = model.build_prefix_cache(asks[0][:k])
    t = median_time(lambda: model.generate_batch_from_prefix_cache(prefix, [a[k:] for a in asks], max_tokens=32,
                                                                  stop_sequences=[]), args.repeats)
    rows.append((f"from prefix ({k} tokens), 4 rows x 32: tok/s", 4 * 32 / t))
    from tinyloop_jax.api.chat import Conversation

    def chat():
        conv = Conversation(model, tok, system="You are a helpful assistant.", max_tokens=64)
        for q in ("What is the capital of France?", "And of Italy?", "Name three rivers in Europe.",
                  "Which is the longest?"):
            "".join(conv.send(q))
        return sum(len(t.answer) for t in conv.turns)
    n_chat = chat()
    rows.append((f"conversation, 4 turns ({n_chat} tokens): tok/s", n_chat / median_time(chat, args.repeats)))
    looped = tl.Model.load(BUNDLED)
    ids = list(b"The history of the printing press begins in the fifteenth century, ")
    t = median_time(lambda: looped.generate(ids, max_tokens=48, draft_loops=1, lookahead=4), args.repeats)
    rows.append(("speculative (bundled looped model, 48 tokens): tok/s", 48 / t))
    import numpy as np
    from bench_kv_modes import decode_speed
    base = tl.ModelConfig(vocab_size=4096, d_model=384, n_heads=6, n_pre_blocks=2, default_loops=8, max_seq_len=2048,
                          kv_mode="fp32")
    params = tl.Model.random(base, seed=0).weights.params
    rng = np.random.default_rng(0)
    prompt, suffix = rng.integers(0, 4096, 1024).astype(np.int32), rng.integers(0, 4096, 8).astype(np.int32)
    for mode in args.modes.split(","):
        speed, _ = decode_speed(tl.Model(params, tl.ModelConfig(**dict(base.to_dict(), kv_mode=mode))), prompt,
                                suffix, args.repeats)
        rows.append((f"kv mode {mode}: decode tok/s", speed))
    report(args, rows + prefix_rows(model, args.repeats) + score_rows(model, args.repeats))


def prefix_rows(model, repeats: int) -> list:
    """Building a prefix (ms) at three prompt lengths, and extending one by 100 tokens."""
    import numpy as np
    from tinyloop_jax.api import functional as F
    rng, rows = np.random.default_rng(0), []
    for n in (100, 300, 1000):
        ids = rng.integers(10, 40000, n).astype(np.int32)
        t = median_time(lambda: model.build_prefix_cache(ids).logits.block_until_ready(), repeats)
        rows.append((f"build_prefix_cache, {n} tokens: ms", t * 1e3))
        if n == 300:  # and keeping every position's stream (a prefix that may go deeper)
            t = median_time(lambda: model.build_prefix_cache(ids, keep_state=True).logits.block_until_ready(), repeats)
            rows.append((f"build_prefix_cache, {n} tokens, keep_state: ms", t * 1e3))
    source = model.build_prefix_cache(ids[:900])
    t = median_time(lambda: F.extend_prefix(source, 900, ids).logits.block_until_ready(), repeats)
    return rows + [("extend a 900-token prefix to 1,000: ms", t * 1e3)]


def score_rows(model, repeats: int) -> list:
    """Scoring (ms): `Model.score` at three lengths, its first call, with top log-probabilities,
    and a batch of held-out bits per byte."""
    import time

    import numpy as np
    from tinyloop_jax.api.evaluate import bits_per_byte
    rng, rows = np.random.default_rng(1), []
    ids = {n: rng.integers(10, 40000, n).astype(np.int32) for n in (100, 300, 1000)}
    t = time.perf_counter()
    model.score(ids[100])
    rows.append(("score, 100 tokens, first call (compiles): ms", (time.perf_counter() - t) * 1e3))
    for n, top in ((100, 0), (300, 0), (1000, 0), (300, 5)):
        t = median_time(lambda: model.score(ids[n], top_logprobs=top), repeats)
        rows.append((f"score, {n} tokens{f', top {top}' if top else ''}: ms", t * 1e3))
    w = model.weights
    data = rng.integers(10, 40000, 8 * 256).astype(np.int32)
    t = median_time(lambda: bits_per_byte(w.params, w.config, data, w.config.default_loops, seq_len=256, batch=8),
                    repeats)
    return rows + [("bits per byte, 8 windows of 256 tokens: ms", t * 1e3)]


def report(args, rows: list) -> None:
    body = "\n".join([f"`{command()}` ({args.label}) on {machine()}.", "", "| call | value |", "|---|---|",
                      *(f"| {name} | {v:.1f} |" for name, v in rows)])
    print(body)
    if not args.no_write:
        print("wrote", write_section("bench_generate", "## `Model.generate` on SmolLM2\n\n" + body))


if __name__ == "__main__":
    main()
