"""The side venv lm-evaluation-harness runs in (never a project dependency: it pulls torch,
transformers, datasets): $TINYLOOP_HOME/venvs/lm-eval with `lm-eval[api]` pinned and a CPU torch.
tests/test_lm_eval.py drives our server with it when the venv exists.

    python scripts/lm_eval_venv.py        # ~2 min here; prints the lm_eval executable's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tinyloop_jax.formats.hub import home  # noqa: E402

PINS = ["lm-eval[api]==0.4.13", "torch==2.13.0"]


def venv_dir() -> str:
    return os.path.join(home(), "venvs", "lm-eval")


def executable() -> str:
    return os.path.join(venv_dir(), "bin", "lm_eval")


def make() -> str:
    if os.path.isfile(executable()):
        return executable()
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", venv_dir()], check=True)
    subprocess.run([os.path.join(venv_dir(), "bin", "pip"), "install", "-q", *PINS], check=True)
    print(f"made {venv_dir()} ({', '.join(PINS)}) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return executable()


if __name__ == "__main__":
    print(make())
