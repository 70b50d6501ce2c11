"""The bundled trained model and the `tinyloop` command line: in-process through `cli.main`, plus
one subprocess run of the installed console script, as a user would."""

import os
import subprocess
import sys

import pytest

import tinyloop_jax as tl
from tinyloop_jax import cli
from tinyloop_jax.cli import BUNDLED
from tinyloop_jax.data import pydoc_split
from tinyloop_jax.api.evaluate import bits_per_byte

# Measured on the committed checkpoint over the first 8192 held-out bytes (docs/quality.md):
# MEASURED_DEFAULT at the default depth, MEASURED_LOOPS1 at loops=1. The bound leaves a small margin.
MEASURED_DEFAULT = 1.6446  # loops=6 (the default)
MEASURED_LOOPS1 = 1.6861
BOUND_DEFAULT = MEASURED_DEFAULT + 0.02


class Run:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def tinyloop(capsys, *args) -> Run:
    """`tinyloop ARGS` in this process: exit code and captured output."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


@pytest.fixture(scope="module")
def bundled():
    return tl.Model.load(BUNDLED)


def test_bundled_model_quality(bundled):
    w = bundled.weights
    _, val = pydoc_split()
    default = bits_per_byte(w.params, w.config, val, w.config.default_loops, max_bytes=8192)
    one = bits_per_byte(w.params, w.config, val, 1, max_bytes=8192)
    assert default < BOUND_DEFAULT, default
    # the looped model uses its loops: measured gap 0.041 bits/byte (2.4%); the full held-out
    # set shows the same (1.719 at loops=1, 1.677 at loops=6)
    assert default < one - 0.03, (default, one)


def test_bundled_model_writes_text(bundled):
    tok = tl.ByteTokenizer()
    out = tok.decode(bundled.generate(tok.encode("The \"if\" statement is used for"), max_tokens=80)[31:])
    words = out.split()
    assert len(words) >= 8 and sum(w.isalpha() for w in words) >= len(words) // 2, out


def test_cli_generate_console_script():
    """The installed `tinyloop` command, in a fresh process (the one subprocess test)."""
    exe = os.path.join(os.path.dirname(sys.executable), "tinyloop")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "tinyloop_jax.cli"]
    r = subprocess.run(cmd + ["generate", "The \"for\" statement", "--max-tokens", "40", "--loops", "4",
                              "--temperature", "0.7", "--top-k", "20", "--stop", "\\n\\n", "--seed", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The \"for\" statement")


@pytest.mark.slow
def test_cli_demo(capsys):
    """The demo offline on the bundled model: the three arms timed, SHARED's and SERVED's
    (greedy) answers equal to NO_CACHE's."""
    r = tinyloop(capsys, "demo", "--model", BUNDLED, "--questions", "2", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert all(f"\n{arm} " in r.stdout for arm in ("NO_CACHE", "SHARED", "SERVED")) and "speedup" in r.stdout
    assert "answers equal NO_CACHE's token for token: SHARED yes, SERVED yes" in r.stdout


def test_cli_eval(capsys):
    r = tinyloop(capsys, "eval", "--loops", "1,2", "--max-bytes", "1024")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.startswith("fp32")]) == 2


@pytest.mark.parametrize("args,msg", [
    (["generate", "hi", "--top-p", "2"], "top_p"),
    (["generate", "hi", "--loops", "0"], "loops"),
    (["generate", "hi", "--loops", "abc"], "invalid int"),
    (["generate", "hi", "--model", "/nonexistent/model"], "no model"),
    (["generate", "hi", "--kv-mode", "bogus"], "kv_mode"),
    (["serve", "--kv-share", "ring:0"], "kv_share='ring:0'"),
    (["generate", ""], "empty"),
    (["eval", "--loops", "x"], "integers"),
    (["eval", "--seq-len", "1"], "--seq-len must be >= 2"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
])
def test_cli_bad_arguments_exit_2(capsys, args, msg):
    r = tinyloop(capsys, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_kv_share_flag_reaches_the_model():
    """`--kv-share` (every command; `tinyloop serve`'s engine serves it) loads the model with it."""
    from tinyloop_jax.cli import model_and_tokenizer_of

    model, _ = model_and_tokenizer_of(None, kv_share="last")
    assert model.config()["kv_share"] == "ring:1"


def test_serve_replicas_refuses_bad_counts_before_ray_starts(capsys):
    for flags, bad in ((["--replicas", "0"], "--replicas must be >= 1"),
                       (["--replicas", "2", "--cores-per-replica", "0"], "--cores-per-replica > 0"),
                       (["--replicas", "2", "--router", "nearest"], "invalid choice")):
        r = tinyloop(capsys, "serve", *flags)
        assert r.returncode == 2 and bad in r.stderr, (flags, r.stderr)
