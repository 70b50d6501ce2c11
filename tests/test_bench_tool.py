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
