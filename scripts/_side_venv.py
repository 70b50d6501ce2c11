"""Side venvs: a tool or reference that needs other packages (transformers 4.5x for Ouro and Huginn,
5.x for Gemma 3, torch, lm-evaluation-harness, llama-cpp-python) runs in a virtual environment of
its own, never the project's. The one way the scripts make them:

    python(venv, packages)         -> the venv's python, made with the pinned packages on first use
    reexec(venv, packages, ready)  -> re-run the calling script there unless `ready()` here

`venv` is a bare name, under root() ($TINYLOOP_HOME/venvs, default ~/.cache/tinyloop/venvs), or a
path (a script's own `--venv`). Standard library only: a script re-run inside a side venv imports
this module there too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

HUB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tinyloop_jax", "formats", "hub.py")


def home() -> str:
    """The project's cache folder, $TINYLOOP_HOME (hub.home(), hub.py read by path: no jax needed)."""
    hub = sys.modules.get("tinyloop_hub")
    if hub is None:
        spec = importlib.util.spec_from_file_location("tinyloop_hub", HUB)
        hub = sys.modules["tinyloop_hub"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
        spec.loader.exec_module(hub)
    return hub.home()


def root() -> str:
    """Where a venv named without a path lies: $TINYLOOP_HOME/venvs."""
    return os.path.join(home(), "venvs")


def where(venv: str) -> str:
    """A venv's folder: a bare name under root(), a path as given (~ expanded)."""
    return os.path.expanduser(venv) if os.sep in venv or venv.startswith("~") else os.path.join(root(), venv)


def python(venv: str, packages: list[str], *, complete=None, pip_args: tuple = (), env: dict | None = None) -> str:
    """`venv`'s python. The first time (or while `complete(python)` is false; default: the python
    exists) `python -m venv`, then `pip install -q *pip_args *packages` with `env` over the
    environment (e.g. CMAKE_ARGS of a source build), timed on stderr."""
    folder = where(venv)
    py = os.path.join(folder, "bin", "python")
    if complete is None:
        complete = os.path.isfile
    if os.path.isfile(py) and complete(py):
        return py
    print(f"making {folder} ({', '.join(packages)}) ...", file=sys.stderr)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", folder], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *pip_args, *packages], check=True,
                   env=None if env is None else dict(os.environ, **env))
    print(f"made {folder} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return py


def reexec(venv: str, packages: list[str], ready) -> None:
    """Return if `ready()` (imports succeed, versions fit) in this interpreter; else re-run this
    script (same argv) with `venv`'s python, after creating it with `packages` if it is missing."""
    try:
        if ready():
            return
    except ImportError:
        pass
    py = python(venv, packages)
    os.execv(py, [py, *sys.argv])
