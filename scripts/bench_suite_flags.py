"""Does an XLA flag (or other code) make the test suite's compiles cheaper? The suite's kind of
program set, compiled in fresh processes with and without it, alternating, medians.

    python scripts/bench_suite_flags.py --flag=--xla_cpu_parallel_codegen_split_count=1
    python scripts/bench_suite_flags.py --flag=... --busy      # another process on the same core
    python scripts/bench_suite_flags.py --tree ../other-checkout [--tree ...]   # code against code
    python scripts/bench_suite_flags.py --preload jemalloc   # another allocator (LD_PRELOAD; the suite's)

Each run is a new process pinned to one core (`taskset -c 0`), with the suite's flags
(tests/conftest.py, less the flag under test) and an empty compilation cache: the tiny test
model and the Ouro-layout model in three KV modes, each running `generate`, `generate_batch`
and a prefix-cache decode (about 100 programs). `--busy` runs a spinning process on that core
meanwhile, as the suite's second xdist worker does. Reports the process CPU seconds and JAX's
compile / trace / lower seconds, median per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SUITE_FLAGS = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
               " --xla_cpu_parallel_codegen_split_count=1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, resource, sys
import jax, jax.monitoring
secs = {"compile": 0.0, "trace": 0.0, "lower": 0.0}
EV = {"backend_compile_duration": "compile", "jaxpr_trace_duration": "trace",
      "jaxpr_to_mlir_module_duration": "lower"}
def listen(event, s, **_):
    key = EV.get(event.rsplit("/", 1)[-1])
    if key:
        secs[key] += s
jax.monitoring.register_event_duration_secs_listener(listen)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.devices()  # the backend reads XLA_FLAGS now, before conftest appends the suite's own
sys.path.insert(0, "tests")
from conftest import ouro_model, prompt_of, tiny_model
r0 = resource.getrusage(resource.RUSAGE_SELF)
for mode in ("fp32", "int8", "int4"):
    for make in (tiny_model, ouro_model):
        m = make(mode)
        m.generate(prompt_of(20), max_tokens=8)
        m.generate_batch([prompt_of(9), prompt_of(30, 1)], max_tokens=5)
        m.generate_from_prefix_cache(m.build_prefix_cache(prompt_of(17)), max_tokens=4, suffix=prompt_of(5, 2))
r1 = resource.getrusage(resource.RUSAGE_SELF)
secs["cpu"] = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
print(json.dumps(secs))
"""


def run_once(extra: str, tree: str = ROOT, preload: str = "") -> dict:
    env = {**os.environ, "XLA_FLAGS": f"{SUITE_FLAGS} {extra}".strip(),
           "JAX_COMPILATION_CACHE_DIR": tempfile.mkdtemp(prefix="bench-flags-")}
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", CHILD], env=env, check=True,
                         capture_output=True, text=True, cwd=tree)  # the tree's tinyloop_jax is imported
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flag", default="",
                    help="the XLA flag under test, e.g. --xla_cpu_parallel_codegen_split_count=1")
    ap.add_argument("--tree", action="append", default=[],
                    help="instead of a flag, a checkout whose code is under test (the same programs, its "
                         "tinyloop_jax); repeat it for several")
    ap.add_argument("--preload", default="",
                    help="instead, a shared library to preload (an allocator): a path, or 'jemalloc' for the one "
                         "the suite uses (ray's wheel's, tests/conftest.py)")
    ap.add_argument("--runs", type=int, default=3, help="runs per variant (alternating)")
    ap.add_argument("--busy", action="store_true", help="a spinning process shares the pinned core")
    ap.add_argument("--no-write", action="store_true", help="(it writes nothing; accepted for bench.py ab)")
    args = ap.parse_args()
    spin = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        if sum(map(bool, (args.flag, args.tree, args.preload))) != 1:
            ap.error("give one of --flag, --tree, --preload")
        preload = args.preload
        if preload == "jemalloc":
            sys.path.insert(0, ROOT)
            from tinyloop_jax.settings import jemalloc

            preload = jemalloc()
            if not preload:
                ap.error("no jemalloc found (ray's wheel ships it: pip install -e '.[test]')")
        variants = {"this checkout": ("", ROOT, "")}
        if args.flag:
            variants[args.flag] = (args.flag, ROOT, "")
        elif preload:
            variants[f"LD_PRELOAD={os.path.basename(preload)}"] = ("", ROOT, preload)
        else:
            variants.update({f"code of {t}": ("", t, "") for t in args.tree})
        rows: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, (flag, tree, lib) in variants.items():
                rows[name].append(run_once(flag, tree, lib))
    finally:
        if spin:
            spin.kill()
    core = "one core shared with a spinning process" if args.busy else "one core"
    print(f"{args.runs} runs each, alternating, {core}; medians:")
    print("| variant | process CPU s | compile s | trace s | lower s |\n|---|---|---|---|---|")
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("cpu", "compile", "trace", "lower")}
        print(f"| {name} | {med['cpu']:.2f} | {med['compile']:.2f} | {med['trace']:.2f} | {med['lower']:.2f} |")


if __name__ == "__main__":
    main()
