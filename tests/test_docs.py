"""The reference pages against the code (issue 63): docs/cli.md is what scripts/make_docs.py
writes from the parser and the settings; every route, request field, /metrics family and
environment variable the code has is named in the docs."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def doc(name: str) -> str:
    with open(os.path.join(ROOT, "docs", name)) as f:
        return f.read()


def test_cli_md_is_what_the_parser_says():
    import make_docs

    assert doc("cli.md") == make_docs.page(), "docs/cli.md is stale: run python scripts/make_docs.py"


def test_every_environment_variable_the_code_reads_has_its_line():
    import make_docs

    listed = " ".join(make_docs.ELSEWHERE) + " " + " ".join(make_docs.settings.VARIABLES)
    reads = re.compile(r"""(?:settings\.get|os\.environ\.get|getenv)\(\s*["']([A-Z_][A-Z0-9_]*)["']"""
                       r"""|["']([A-Z_][A-Z0-9_]*)["']\s+(?:not\s+)?in\s+os\.environ""")
    found = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "tinyloop_jax")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f)) as fh:
                    found |= {a or b for a, b in reads.findall(fh.read())}
    assert found and not {v for v in found if v not in listed}, found
    cli = doc("cli.md")
    assert all(f"`{name}`" in cli for name in make_docs.settings.VARIABLES)


def test_every_route_and_metrics_family_is_in_serving_md():
    pytest.importorskip("starlette", reason="the serve extra installs starlette")
    from tinyloop_jax.serving.app import make_app
    from tinyloop_jax.serving.metrics import Collector

    serving = doc("serving.md")
    app = make_app(engine=None, tokenizer=None)
    for route in app.routes:
        for method in sorted(route.methods - {"HEAD"}):
            assert f"`{method} {route.path}`" in serving, (method, route.path)
    names = [*Collector.COUNTERS, *Collector.GAUGES, *Collector.DEPTH_COUNTERS, *Collector.REPLICA_TOTALS]
    names += [f"replica_{n}" for n in (*Collector.REPLICA_COUNTERS, *Collector.REPLICA_GAUGES)]
    missing = [n for n in names + ["requests_finished"] if f"`tinyloop_{n}`" not in serving
               and f"`tinyloop_{n}{{" not in serving]
    assert not missing, missing


class Recorder(dict):
    """A request body that records every field the parser asks about."""

    def __init__(self, body, seen):
        super().__init__(body)
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


def test_every_request_field_the_parsers_read_is_in_the_fields_table():
    """The fields `/v1/completions`, `/v1/chat/completions` and the tokenizer routes read (a body
    recording what the parsers ask of it, with the fields that open others set) each have a row
    of serving.md's tables."""
    from test_server_api import TOK
    from tinyloop_jax.serving import protocol as P

    seen: set = set()
    extras = dict(draft_loops=1, stream_options={})  # (lookahead is read with draft_loops)
    P.parse(Recorder(dict(prompt="hi", **extras), seen), TOK, "tiny", [0])
    P.parse_chat(Recorder(dict(messages=[dict(role="user", content="hi")], **extras), seen), TOK, "tiny", [0], 128)
    from tinyloop_jax.serving import tokenizer_api as TA

    TA.tokenize(Recorder(dict(prompt="hi"), seen), TOK, "tiny", 128)
    TA.tokenize(Recorder(dict(messages=[dict(role="user", content="hi")]), seen), TOK, "tiny", 128)
    TA.detokenize(Recorder(dict(tokens=[104]), seen), TOK, "tiny", 260)
    rows = [line for line in doc("serving.md").splitlines() if line.startswith("| `")]
    missing = sorted(f for f in seen if not any(f"`{f}`" in r.split("|")[1] for r in rows))
    assert len(seen) > 30 and not missing, missing


def test_user_docs_speak_of_the_product_not_its_history():
    """The pages a user reads name no issue, session or seed document (those live in
    docs/engine-plan.md, docs/benchmarks*.md and git)."""
    history = re.compile(r"\b(?:issues?|sessions?) \d+|\bseed 000|\bthe seed's\b", re.I)
    for name in ("../README.md", "reference.md", "serving.md", "formats.md", "ouro.md", "guide.md",
                 "architecture.md", "cli.md"):
        found = history.findall(doc(name))
        assert not found, (name, found)
