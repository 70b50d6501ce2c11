"""Compile time and compiled program size against loop depth.

    python scripts/bench_compile.py                       # loops 1,4,8,32,128; bundled + GPT-2-small shape
    python scripts/bench_compile.py --loops 4,32 --models bundled --no-write

Each (model, loops) point runs in a fresh subprocess (no compiled program or compilation cache
carried over) that makes one public call, `model.generate(prompt, loops=L, max_tokens=4)`, with
XLA dumping every program it compiles. Reported per point:
  * compile s: XLA backend compile seconds summed over the call's programs (`jax.monitoring`),
  * first call s: wall time of that first call (trace + lower + compile + run),
  * HLO instructions of the prefill and decode programs after optimization (counted in the dump).
Only public API and XLA's own dump are used, so the same script measures any version of the code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
import jax, numpy as np
sys.path.insert(0, {root!r})
import tinyloop_jax as tl

compile_s = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: compile_s.append(secs) if name.endswith("backend_compile_duration") else None)
model_name, loops = {model!r}, {loops}
if model_name == "bundled":
    from tinyloop_jax.cli import BUNDLED
    model = tl.Model.load(BUNDLED, kv_mode="fp32")
else:  # GPT-2-small shape: 11 distinct blocks + the looped 12th
    model = tl.Model.random(tl.ModelConfig(vocab_size=50257, d_model=768, n_heads=12, n_pre_blocks=11,
                                           default_loops=1, max_seq_len=1024, kv_mode="fp32"), seed=0)
prompt = np.arange(16) % 200
t = time.perf_counter()
model.generate(prompt, loops=loops, max_tokens=4)
first = time.perf_counter() - t
print(json.dumps(dict(compile_s=sum(compile_s), first_s=first)))
"""


def hlo_sizes(dump: str) -> dict[str, int]:
    """{program name: instructions} of every optimized module XLA dumped."""
    out = {}
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        name = re.sub(r"^module_\d+\.", "", os.path.basename(path)).split(".")[0]
        with open(path) as f:
            n = sum(1 for line in f if re.match(r"\s*(ROOT )?%\S+ = ", line))
        out[name] = max(n, out.get(name, 0))
    return out


def measure(model: str, loops: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
                   JAX_ENABLE_COMPILATION_CACHE="false")
        code = CHILD.format(root=ROOT, model=model, loops=loops)
        try:
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{model} loops={loops} failed:\n{r.stderr[-3000:]}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        sizes = hlo_sizes(dump)
    # the programs of one generate call: a prefill (names vary across versions) and the decode loop
    res["prefill"] = max((n for k, n in sizes.items() if "prefill" in k), default=0)
    res["decode"] = max((n for k, n in sizes.items() if "decode" in k), default=0)
    res["total"] = sum(sizes.values())
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loops", default="1,4,8,32,128")
    ap.add_argument("--models", default="bundled,gpt2-small")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per point before it is reported as '>'")
    ap.add_argument("--label", default="after", help="row label, e.g. before / after")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for loops in (int(x) for x in args.loops.split(",")):
            r = measure(model, loops, args.timeout)
            rows.append((model, loops, r))
            print(model, loops, r, flush=True)

    def cell(r, key, fmt):
        return f"> {r['timeout']:.0f}" if "timeout" in r else fmt.format(r[key])

    lines = [f"| {args.label} | {m} | {L} | {cell(r, 'compile_s', '{:.2f}')} | {cell(r, 'first_s', '{:.2f}')} | "
             f"{cell(r, 'prefill', '{:,}')} | {cell(r, 'decode', '{:,}')} | {cell(r, 'total', '{:,}')} |"
             for m, L, r in rows]
    print("\n".join(lines))
    if not args.no_write:
        body = "\n".join([
            f"Command: `{_report.command()}`  ",
            f"Machine: {_report.machine()}  ",
            "",
            "| code | model | loops | XLA compile s | first call s | prefill HLO instr. | decode HLO instr. "
            "| all programs HLO instr. |",
            "|---|---|---|---|---|---|---|---|",
            *lines])
        print("wrote", _report.write_section(f"bench_compile_{args.label}", body))


if __name__ == "__main__":
    main()
