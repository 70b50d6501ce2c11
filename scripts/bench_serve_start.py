"""How fast `tinyloop serve` starts, as a new user meets it: seconds from the command to /health
answering, to the first completion answered, and to the end of the background warmup, on a cold
compilation cache (a fresh folder per start), for the bundled model and SmolLM2 (defaults).

    python scripts/bench_serve_start.py [--models bundled,smollm2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="bundled,smollm2")
    ap.add_argument("--kinds", action="store_true",
                    help="also start with every kind warmed (--warmup-adaptive --warmup-speculation 1:4)")
    ap.add_argument("--no-write", action="store_true", help="print only (an A/B run)")
    args = ap.parse_args()
    import _report
    from bench_smollm2 import serve_ready

    rows = []
    every = ["--warmup-adaptive", "--warmup-speculation", "1:4"]
    arms = [("", [])] + ([(" (every kind)", every)] if args.kinds else [])
    for name in args.models.split(","):
        for label, extra in arms:
            health, first, warm = serve_ready(None if name == "bundled" else name, extra)
            print(f"{name}{label} /health: {health:.1f} s")
            print(f"{name}{label} first completion: {first:.1f} s")
            print(f"{name}{label} warmup done: {warm:.1f} s")
            rows.append(f"| {name}{label} | {health:.1f} | {first:.1f} | {warm:.1f} |")
    body = "\n".join([
        "## `tinyloop serve` start-up (`scripts/bench_serve_start.py`)", "",
        f"Command: `{_report.command()}`  ", f"Machine: {_report.machine()}", "",
        "Seconds from starting `tinyloop serve --model NAME` (default flags: 16-row batch buckets, 2048-position "
        "pool slots) on an empty compilation cache to `/health` answering, to the first completion (8 greedy "
        "tokens) answered, and to the end of the background warmup (`/health` `warming: false`), after which "
        "serving compiles nothing more.", "",
        "| model | /health s | first completion s | warmup done s |", "|---|---|---|---|", *rows])
    print(body)
    if not args.no_write:
        print("wrote", _report.write_section("bench_serve_start", body))


if __name__ == "__main__":
    main()
