"""The side venv lm-evaluation-harness runs in (never a project dependency: it pulls torch,
transformers, datasets): $TINYLOOP_HOME/venvs/lm-eval with `lm-eval[api]` pinned and a CPU torch,
made by `_side_venv.python`. tests/test_lm_eval.py drives our server with it when the venv exists.

    python scripts/lm_eval_venv.py        # ~2 min here; prints the lm_eval executable's path
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _side_venv  # noqa: E402

NAME = "lm-eval"
PINS = ["lm-eval[api]==0.4.13", "torch==2.13.0"]


def venv_dir() -> str:
    return _side_venv.where(NAME)


def executable() -> str:
    return os.path.join(venv_dir(), "bin", "lm_eval")


def make() -> str:
    _side_venv.python(NAME, PINS, complete=lambda py: os.path.isfile(executable()))
    return executable()


if __name__ == "__main__":
    print(make())
