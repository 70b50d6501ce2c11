"""Shared helpers for benchmark scripts: timing medians and writing a section of docs/."""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time

import jax

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
WRITE = True  # False after a script's `--no-write` (`NoWrite`): `write_section` writes nothing


class NoWrite(argparse.Action):
    """A script's `--no-write` (`ap.add_argument("--no-write", action=_report.NoWrite)`): print
    the figures, write no docs (`bench.py ab` passes it to every suite's script)."""

    def __init__(self, option_strings, dest, **kw):
        kw.setdefault("help", "print only: write no docs (bench.py ab passes it)")
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        global WRITE
        WRITE = False
        setattr(namespace, self.dest, True)


def median_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of fn() (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def machine() -> str:
    return (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"jax {jax.__version__}, backend {jax.default_backend()}")


def command() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def heading(title: str) -> list[str]:
    """A section's first lines: its title, the command that wrote it, the machine."""
    return [f"## {title}", "", f"Command: `{command()}`  ", f"Machine: {machine()}", ""]


def write_section(name: str, body: str, path: str = "benchmarks.md") -> str:
    """Replace (or append) the section `name` of docs/<path>, delimited by HTML comments (nothing
    after `--no-write`). Returns what it wrote."""
    if not WRITE:
        return "nothing (--no-write)"
    os.makedirs(DOCS, exist_ok=True)
    full = os.path.join(DOCS, path)
    text = "# Benchmarks\n\nEach section is written by the script it names.\n"
    if os.path.exists(full):
        with open(full) as f:
            text = f.read()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(full, "w") as f:
        f.write(text)
    return full


def progress(i: int, n: int, label: str) -> None:
    """A one-line progress bar on stderr."""
    w = 30
    done = int(w * i / max(n, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (w - done)}] {i}/{n} {label:<40}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()
