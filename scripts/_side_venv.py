"""A reference that needs other package versions (transformers 4.5x for Ouro and Huginn, 5.x for
Gemma 3, torch) runs in a virtual environment of its own, never the project's: `reexec` re-runs
the calling script there, making the venv on first use."""

from __future__ import annotations

import os
import subprocess
import sys


def reexec(venv: str, packages: list[str], ready) -> None:
    """Return if `ready()` (imports succeed, versions fit) in this interpreter; else re-run this
    script (same argv) with `venv`'s python, after creating it with `packages` if it is missing."""
    try:
        if ready():
            return
    except ImportError:
        pass
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        print(f"making {venv} ({', '.join(packages)}) ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        subprocess.check_call([py, "-m", "pip", "install", "-q", *packages])
    os.execv(py, [py, *sys.argv])
