"""A `Conversation` on SmolLM2-135M-Instruct as shipped (the chat of `tinyloop chat`): time to
first token of each of 8 turns and the chat's tokens/s, greedy answers of up to 64 tokens.
Run it in two trees back to back to compare (it prints one markdown row per run):

    python scripts/bench_chat.py                                   # this tree
    PYTHONPATH=/path/to/other/tree python scripts/bench_chat.py --label before

Medians of --repeats conversations after two warm-up conversations (which compile). tok/s
counts the turns whose answers are the same in both trees' runs (--turns, default the first 7:
the 8th ends at a greedy near-tie that the two trees break differently), prefills included.
"""

from __future__ import annotations

import argparse
import statistics

import tinyloop_jax as tl
from tinyloop_jax.api.chat import Conversation

QUESTIONS = ("What is the capital of France?", "And of Italy?", "Name three rivers in Europe.",
             "Which is the longest?", "And in Asia?", "What about Africa?", "Which of them is the widest?",
             "Thank you.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--no-write", action="store_true", help="(it writes nothing; accepted for bench.py ab)")
    args = ap.parse_args()
    model, tok = tl.Model.from_pretrained("smollm2"), tl.load_tokenizer("smollm2")

    def chat():
        conv = Conversation(model, tok, system="You are a helpful assistant.", max_tokens=64)
        for q in QUESTIONS:
            "".join(conv.send(q))
        return conv.turns

    chat(), chat()
    runs = [chat() for _ in range(args.repeats)]
    k = args.turns
    tokens = sum(len(t.answer) for t in runs[0][:k])
    seconds = statistics.median(sum(t.seconds for t in turns[:k]) for turns in runs)
    ttft = [round(1000 * statistics.median(turns[i].first_token_s for turns in runs)) for i in range(len(QUESTIONS))]
    print(f"| {args.label} | {' / '.join(map(str, ttft))} | {statistics.median(ttft)} | {tokens} | "
          f"{tokens / seconds:.1f} | {' / '.join(str(t.prefill_tokens) for t in runs[0])} |")


if __name__ == "__main__":
    main()
