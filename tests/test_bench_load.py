"""The load generator and report of the serving benchmarks (`scripts/_load.py`, used by
bench_serve_load.py and bench_vs_llamaserver.py) against the bundled model on a tiny load: the
same code that drives both servers in the benchmark, with no llama.cpp build in the suite."""

import os
import sys

import pytest

import tinyloop_jax as tl
from tinyloop_jax.cli import BUNDLED

pytest.importorskip("openai", reason="the test extra installs the openai client")
pytest.importorskip("uvicorn", reason="the serve extra installs uvicorn")

from test_server import Server  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import _load  # noqa: E402


def test_load_generator_and_report_against_the_bundled_model():
    model = tl.Model.load(BUNDLED)  # its context is 256 bytes: short system prompts, short answers
    server = Server(model, eos=(), name="bundled", max_batch=4)
    try:
        work = _load.Workload(model="bundled", systems=("def add(a, b):", "class Point:"), max_tokens=6,
                              per_client=2, chat=False, question=lambda c, j: f"# case {c}-{j}")
        _load.warm(server.url, work)
        loads = [_load.load(server.url, work, n, seed=n) for n in (1, 3)]
    finally:
        server.close()
    # every request streamed and counted its 6 tokens (the usage of its last chunk)
    assert [[r.tokens for r in ld.results] for ld in loads] == [[6] * 2, [6] * 6]
    assert all(len(r.itl) == r.chunks - 1 and 1 <= r.chunks <= 6 for ld in loads for r in ld.results)
    rows = [_load.summary(ld, _load.peak_rss(os.getpid())) for ld in loads]
    for r, n in zip(rows, (1, 3)):
        assert r.clients == n
        assert r.tps > 0 and r.lat50 > 0 and 0 < r.ttft50 <= r.ttft99 and r.rss > 0 and 1 <= r.per_chunk <= 6
    lines = _load.table([("tinyloop", r) for r in rows])
    assert lines[:2] == _load.HEADER and len(lines) == 4 and lines[3].startswith("| tinyloop | 3 | ")
    assert "3 clients:" in _load.line(rows[1])
