"""One benchmark command: a registry of the suites, each the script that writes its section of
docs/benchmarks.md, and one A/B runner for two trees.

    python scripts/bench.py list                       # the suites: script, what it measures
    python scripts/bench.py run sampling               # the suite's script (writes its section)
    python scripts/bench.py run engine -- --rows 1,16  # arguments after -- go to the script
    python scripts/bench.py ab engine --tree /tmp/before [--runs 2]
    python scripts/bench.py ab kv-share --tree /tmp/before -- --quick   # the script's own flags

`ab` runs the suite's script of each tree in turn (`--tree` against this checkout, or `--tree A
--tree B`), alternated `--runs` times, each a fresh process with that tree's package first on
the path, and prints one markdown table: every "<name>: <number> tok/s" (or "s", "ms", "MiB")
line the script prints, each run's value, the medians and their ratio. A suite's A/B arguments
(no docs written, fewer repeats) come from the registry. A tree is a checkout or a `git
worktree add /tmp/before <commit>`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Suite:
    script: str  # in scripts/
    what: str
    ab: tuple = ("--no-write",)  # the script's arguments for an A/B run


SUITES = {
    "sampling": Suite("bench_sampling.py", "sampled decode next to greedy: generate batch 1, the engine at 16 rows",
                      ("--no-write", "--no-paths", "--repeats", "3")),
    "engine": Suite("bench_engine.py", "one client: generate, the engine in process and over HTTP; step times",
                    ("--no-write", "--skip-steps", "--repeats", "3")),
    "generate": Suite("bench_generate.py", "Model.generate and the prefix-cache calls on SmolLM2"),
    "serve-load": Suite("bench_serve_load.py", "tinyloop serve: start-up, 1/4/16 clients, memory"),
    "vs-llamaserver": Suite("bench_vs_llamaserver.py", "tinyloop serve against llama.cpp's server, same GGUF"),
    "vs-llamacpp": Suite("bench_vs_llamacpp.py", "generate against llama.cpp's CLI, same GGUF"),
    "vs-hf": Suite("bench_vs_hf.py", "against Hugging Face transformers on a GPT-2-small shape"),
    "vs-ouro": Suite("bench_vs_ouro.py", "against Ouro's reference code"),
    "prefix-cache": Suite("bench_prefix_cache.py", "the seed's prefix-sharing table: NO_CACHE vs SHARED"),
    "decode": Suite("bench_decode.py", "batch-1 decode against the memory-bandwidth bound"),
    "memory": Suite("measure_memory.py", "what the compiled programs allocate (XLA's memory analysis)"),
    "kv-modes": Suite("bench_kv_modes.py", "each KV mode's bytes, decode speed, quality"),
    "loops": Suite("bench_loops.py", "self-speculative decoding and depth-flexible prefixes"),
    "adaptive": Suite("bench_adaptive.py", "adaptive depth: decode time against passes run"),
    "chat": Suite("bench_chat.py", "a Conversation's turns on a kept page pool"),
    "activations": Suite("bench_activations.py", "8-bit activations against float32 in the packed products"),
    "quant": Suite("bench_quant.py", "packed weights on XLA:CPU"),
    "mesh": Suite("bench_mesh.py", "bytes and collectives per device on 1-8 device meshes"),
    "layer-windows": Suite("bench_layer_windows.py", "Gemma 3's per-layer windows: cache bytes, speed"),
    "smollm2": Suite("bench_smollm2.py", "SmolLM2 end to end against transformers"),
    "serve": Suite("bench_serve.py", "the serving loop under a Zipf load, engine arms"),
    "serve-start": Suite("bench_serve_start.py", "seconds from `tinyloop serve` to /health"),
    "compile": Suite("bench_compile.py", "compile time and program size against depth"),
    "ouro-shape": Suite("bench_ouro_shape.py", "Ouro-1.4B's shape with random weights"),
    "cascade": Suite("bench_cascade.py", "rows sharing a system prompt's pages in one attention"),
    "quality": Suite("quality_weights.py", "bits per byte of each weight form"),
    "profile-decode": Suite("profile_decode.py", "where a batch-1 decode step goes"),
    "profile-serving": Suite("profile_serving.py", "where a served step's time and the server's memory go"),
    "profile-warmup": Suite("profile_warmup.py", "the engine's warmup by program kind, and the cost of fewer programs"),
    "structured": Suite("bench_structured.py", "structured output's cost: constrained against free decoding"),
    "replicas": Suite("bench_replicas.py", "replicas on Ray Serve: each router's hit rate, TTFT, tokens/s"),
    "kv-share": Suite("bench_kv_share.py", "kv_share: bytes a token, what a budget holds, decode speed, quality"),
    "suite-time": Suite("suite_profile.py", "where the test suite's time goes", ()),
    "suite-flags": Suite("bench_suite_flags.py", "an XLA flag's effect on the suite's compiles"),
    "house": Suite("house.py", "issue 59's structural counts (jit sites, long files, import circles)", ()),
}

# "<name>: <number> <unit>" lines of a script's output (tok/s, s, ms, MiB, GiB)
METRIC = re.compile(r"^\s*(?P<name>[^|:][^:]*?):\s+(?P<value>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>tok/s|ms|s|MiB|GiB)\b")


def metrics(text: str) -> dict[str, tuple[float, str]]:
    """{name: (value, unit)} of every metric line in a script's output (the last of a name wins)."""
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m:
            out[m["name"].strip()] = (float(m["value"]), m["unit"])
    return out


def run_script(tree: str, suite: Suite, args: list[str]) -> str:
    """The suite's script of `tree`, in a fresh process whose path starts with that tree."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, os.path.join(tree, "scripts", suite.script), *args]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"{suite.script} failed in {tree} (exit {done.returncode})")
    return done.stdout


def ab_table(labels: list[str], runs: dict[str, list[dict]]) -> str:
    """The markdown table of an A/B: per metric, each tree's runs, medians, the ratio to the first."""
    names = [n for n in runs[labels[0]][0] if all(n in r for lab in labels for r in runs[lab])]
    head = "| metric | " + " | ".join(f"{lab} (each run)" for lab in labels) + " | " + \
        " | ".join(f"{lab} / {labels[0]}" for lab in labels[1:]) + " |"
    rows = [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for n in names:
        unit = runs[labels[0]][0][n][1]
        med = {lab: statistics.median(r[n][0] for r in runs[lab]) for lab in labels}
        cells = [", ".join(f"{r[n][0]:g}" for r in runs[lab]) for lab in labels]
        ratios = [f"{med[lab] / med[labels[0]]:.2f}" if med[labels[0]] else "-" for lab in labels[1:]]
        rows.append(f"| {n} ({unit}) | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(rows)


def parse(argv=None) -> argparse.Namespace:
    """The command line; `ns.args` are the script's arguments: what follows the suite that
    bench.py does not take itself (`run decode --no-write`; `ab kv-share --tree T -- --quick`)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("suite", choices=sorted(SUITES))
    a = sub.add_parser("ab")
    a.add_argument("suite", choices=sorted(SUITES))
    a.add_argument("--tree", action="append", required=True, help="a checkout (twice: A and B; once: it and this one)")
    a.add_argument("--runs", type=int, default=2, help="alternations")
    ns, rest = ap.parse_known_args(argv)  # (a script's own flags are unknown here: they are the script's)
    if ns.cmd == "ab" and ns.runs < 1:
        a.error(f"--runs must be at least 1, got {ns.runs}")
    ns.args = rest[1:] if rest[:1] == ["--"] else rest
    return ns


def main(argv=None) -> None:
    ns = parse(argv)
    if ns.cmd == "list":
        for name, s in SUITES.items():
            print(f"{name:16} scripts/{s.script:26} {s.what}")
        return
    suite = SUITES[ns.suite]
    if ns.cmd == "run":
        raise SystemExit(subprocess.call([sys.executable, os.path.join(HERE, suite.script), *ns.args]))
    trees = [os.path.abspath(t) for t in ns.tree] + ([ROOT] if len(ns.tree) == 1 else [])
    labels = [os.path.basename(t.rstrip("/")) or t for t in trees]
    if len(set(labels)) < len(labels):
        labels = [f"{lab} ({i})" for i, lab in enumerate(labels)]
    args = ns.args or list(suite.ab)
    runs: dict[str, list[dict]] = {lab: [] for lab in labels}
    for _ in range(ns.runs):
        for lab, tree in zip(labels, trees):
            runs[lab].append(metrics(run_script(tree, suite, args)))
    print(f"`python scripts/bench.py ab {ns.suite} " + " ".join(f"--tree {t}" for t in ns.tree)
          + f" --runs {ns.runs}`" + (f" (script arguments: {' '.join(args)})" if args else "") + "\n")
    print(ab_table(labels, runs))


if __name__ == "__main__":
    main()
