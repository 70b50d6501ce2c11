"""Adaptive depth on the bundled looped model: `generate` with an exit criterion, the prompt
prefilled at full depth or exiting as a whole (`exit_in_prefill`). Run it in two trees back to
back to compare (one line per run: median ms of 7 calls after two warm-up calls, and the passes
run over the call's tokens):

    python scripts/bench_adaptive.py --label after
    PYTHONPATH=/path/to/other/tree python scripts/bench_adaptive.py --label before
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import tinyloop_jax as tl

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tinyloop-pydoc")
CASES = (("kl 1e-2, exit in prefill", dict(exit_criterion="kl", exit_threshold=1e-2, exit_in_prefill=True)),
         ("kl 1e-2", dict(exit_criterion="kl", exit_threshold=1e-2)),
         ("latent-diff 0.05, exit in prefill", dict(exit_criterion="latent-diff", exit_threshold=0.05,
                                                    exit_in_prefill=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--no-write", action="store_true", help="(it writes nothing; accepted for bench.py ab)")
    args = ap.parse_args()
    m = tl.Model.load(BUNDLED)
    ids = list(b"The history of the printing press begins in the fifteenth century, when Johannes Gutenberg " * 2)
    out = []
    for name, kw in CASES:
        def call():
            m.generate(ids, max_tokens=32, **kw)
        call(), call()
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        out.append(f"{name}: {statistics.median(times) * 1000:.1f} ms, {sum(m.last_passes)} passes")
    print(args.label, "|", " | ".join(out))


if __name__ == "__main__":
    main()
