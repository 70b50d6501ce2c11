"""`scripts/bench.py`, the one benchmark command: its registry names scripts that exist, and its
A/B reads the metric lines the scripts print."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))

import bench  # noqa: E402


def test_every_suite_is_a_script():
    for name, suite in bench.SUITES.items():
        assert os.path.exists(os.path.join(bench.HERE, suite.script)), name


def test_ab_reads_metric_lines_and_tables_medians():
    out = ("generate batch 1, greedy: 181.5 tok/s\nEngine, in process: 155.6 tok/s (92%), TTFT 0.055 s\n"
           "| knobs | tok/s |\nwarm-up: 12 s\nnot a metric: fast\n")
    assert bench.metrics(out) == {"generate batch 1, greedy": (181.5, "tok/s"), "Engine, in process": (155.6, "tok/s"),
                                  "warm-up": (12.0, "s")}
    runs = {"before": [{"x": (100.0, "tok/s")}, {"x": (110.0, "tok/s")}],
            "after": [{"x": (99.0, "tok/s")}, {"x": (121.0, "tok/s")}, {"x": (200.0, "tok/s")}]}
    table = bench.ab_table(["before", "after"], runs).splitlines()
    assert table[2] == "| x (tok/s) | 100, 110 | 99, 121, 200 | 1.15 |"  # medians 105 and 121


def test_a_scripts_own_flags_pass_through():
    """What follows the suite and is not bench.py's own goes to the script, flags included, with
    or without a `--` before it."""
    assert bench.parse(["run", "decode", "--no-write", "--new", "8"]).args == ["--no-write", "--new", "8"]
    ns = bench.parse(["ab", "kv-share", "--tree", "/tmp/a", "--runs", "3", "--", "--quick"])
    assert (ns.tree, ns.runs, ns.args) == (["/tmp/a"], 3, ["--quick"])
    ns = bench.parse(["ab", "decode", "--tree", "/tmp/a", "--no-write"])
    assert (ns.tree, ns.runs, ns.args) == (["/tmp/a"], 2, ["--no-write"])
    assert bench.parse(["ab", "decode", "--tree", "/tmp/a"]).args == []  # then the suite's A/B ones


def test_every_suites_script_takes_its_ab_arguments():
    """`bench.py ab <suite>` passes the suite's A/B arguments (`--no-write` unless the registry
    says otherwise) to its script, so each script must take every one of them: read from the
    scripts' sources (two had failed on `--no-write`)."""
    for name, suite in bench.SUITES.items():
        with open(os.path.join(bench.HERE, suite.script)) as f:
            source = f.read()
        for flag in (a for a in suite.ab if a.startswith("--")):
            assert f'"{flag}"' in source, (name, suite.script, flag)


def test_no_write_leaves_the_docs_alone(tmp_path, monkeypatch):
    """A script's `--no-write` (`_report.NoWrite`) turns `write_section` into a no-op."""
    import argparse

    import _report

    monkeypatch.setattr(_report, "DOCS", str(tmp_path))
    monkeypatch.setattr(_report, "WRITE", True)
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-write", action=_report.NoWrite)
    assert ap.parse_args([]).no_write is False and _report.WRITE
    _report.write_section("x", "body")
    assert (tmp_path / "benchmarks.md").exists()
    (tmp_path / "benchmarks.md").unlink()
    assert ap.parse_args(["--no-write"]).no_write is True
    assert _report.write_section("x", "body") == "nothing (--no-write)" and not (tmp_path / "benchmarks.md").exists()
