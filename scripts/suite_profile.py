"""Where the test suite's time goes: per test, wall time against JAX's own compile events.

    python scripts/suite_profile.py                 # the whole suite, a cold compilation cache
    python scripts/suite_profile.py tests/test_batch.py -k fp32

Runs pytest (its arguments pass through) with this file as a plugin: every test's wall time and
the seconds JAX reports through `jax.monitoring` — tracing to a jaxpr, lowering to MLIR, XLA's
backend compile, persistent-cache loads — with their counts, one JSON line per test. Then
prints the totals and the files by wall time. Compiles in subprocesses (the mesh checks,
`tinyloop serve`, the CLI) are not seen: their tests show as wall time only.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time

OUT = "TINYLOOP_SUITE_PROFILE"  # the folder the workers write to (set by main for the plugin)
EVENTS = {"trace": "/jax/core/compile/jaxpr_trace_duration",
          "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
          "compile": "/jax/core/compile/backend_compile_duration",
          "cache load": "/jax/compilation_cache/cache_retrieval_time_sec"}

# ---- the plugin (imported by pytest in each worker) ---------------------------------------------

_now: collections.Counter = collections.Counter()

if os.environ.get(OUT):
    import jax.monitoring
    import pytest

    def _listen(event: str, seconds: float, fun_name: str = "", **_) -> None:
        _now[event] += seconds
        _now["n " + event] += 1
        if event == EVENTS["compile"]:  # which programs the compile time goes to
            _now["fn " + fun_name] += seconds
        elif event in (EVENTS["trace"], EVENTS["lower"]) and fun_name:  # and the tracing and lowering
            _now["fn+ " + fun_name.removeprefix("jit(").removesuffix(")").removeprefix("jit_")] += seconds

    jax.monitoring.register_event_duration_secs_listener(_listen)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _now.clear()
        t, start = time.perf_counter(), time.time()
        yield
        row = {"test": item.nodeid, "wall": time.perf_counter() - t, **_now, "start": start, "pid": os.getpid()}
        with open(os.path.join(os.environ[OUT], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


# ---- the runner ---------------------------------------------------------------------------------

def summarize(rows: list[dict]) -> str:
    tot = collections.Counter()
    files: dict = collections.defaultdict(collections.Counter)
    programs = collections.Counter()  # compile seconds by program name (and tests compiling it)
    for r in rows:
        for k, v in r.items():
            if k.startswith("fn "):
                programs[k[3:]] += v
                programs["n " + k[3:]] += 1
            elif k.startswith("fn+ "):
                programs["tl " + k[4:]] += v
            elif k not in ("test", "start", "pid"):
                tot[k] += v
                files[r["test"].split("::")[0]][k] += v
    lines = [f"{len(rows)} tests, {tot['wall']:.0f} s of test time (all workers)"]
    for name, ev in EVENTS.items():
        lines.append(f"  {name:10s} {tot[ev]:8.1f} s  {tot[ev] / max(tot['wall'], 1e-9):5.1%}  "
                     f"({tot['n ' + ev]:.0f} events)")
    # each worker's span: an early finisher idles while the other runs its last tests
    spans = collections.defaultdict(list)
    for r in rows:
        spans[r.get("pid")].append((r.get("start", 0.0), r.get("start", 0.0) + r["wall"]))
    t0 = min((a for s in spans.values() for a, _ in s), default=0.0)
    for pid, s in sorted(spans.items(), key=lambda kv: max(b for _, b in kv[1])):
        lines.append(f"  worker {pid}: {len(s)} tests, busy {sum(b - a for a, b in s):.0f} s, "
                     f"last test ends at {max(b for _, b in s) - t0:.0f} s")
    lines.append("\n  wall s  compile s  compiles  file")
    for f, c in sorted(files.items(), key=lambda kv: -kv[1]["wall"]):
        lines.append(f"{c['wall']:8.1f} {c[EVENTS['compile']]:10.1f} {c['n ' + EVENTS['compile']]:9.0f}  {f}")
    lines.append("\n  compile s  trace+lower s  tests  program")
    for name, secs in sorted(((k, v) for k, v in programs.items() if not k.startswith(("n ", "tl "))),
                             key=lambda kv: -kv[1])[:40]:
        bare = name.removeprefix("jit(").removesuffix(")")
        lines.append(f"{secs:11.1f} {programs['tl ' + bare]:14.1f} {programs['n ' + name]:6.0f}  {name}")
    small = sum(v for k, v in programs.items() if k.startswith("tl ") and "jit(" + k[3:] + ")" not in programs)
    lines.append(f"  (trace + lower of functions never compiled on their own, e.g. inner jits: {small:.1f} s)")
    return "\n".join(lines)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    out = tempfile.mkdtemp(prefix="suite-profile-")
    env = dict(os.environ, **{OUT: out}, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    env.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="suite-profile-cache-"))  # cold
    t = time.perf_counter()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_profile", *(sys.argv[1:] or ["tests"])],
                         cwd=os.path.dirname(here), env=env)
    rows = [json.loads(line) for f in os.listdir(out) for line in open(os.path.join(out, f))]
    print(f"\npytest exited {rc} after {time.perf_counter() - t:.0f} s wall (per-test rows in {out})\n"
          + summarize(rows))
    sys.exit(rc)


if __name__ == "__main__":
    main()
