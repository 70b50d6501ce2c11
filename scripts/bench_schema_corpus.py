"""Structured output on a schema corpus (issue 60): every draft 2020-12 case of the official
JSON-Schema-Test-Suite (MIT), as shipped in `jsonschema`'s source distribution (fetched once with
`pip download --no-binary`, cached under ~/.cache/tinyloop/schema-corpus): a few hundred schemas,
each with instances the suite marks valid or invalid.

For each schema, against SmolLM2's tokenizer (49,152 ids): does it compile
(`Grammar.of({"type": "json_schema", ...})`, else the ValueError's reason); for each instance
(`json.dumps`, tokenized as the model would write it): does the mask accept it — every token in
the mask of what may follow the tokens before it, then the end allowed — and how long each mask
takes (llguidance's fill, one row). An accepted invalid instance is a constraint the mask does not
enforce; a rejected valid one is an output the mask forbids (a key order, whitespace, a keyword
it approximates).

    python scripts/bench_schema_corpus.py [--no-write]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SDIST = "jsonschema==4.25.1"
DRAFT = "draft2020-12"


def corpus() -> list[tuple[str, str, object, list]]:
    """(file, case description, schema, [(instance, valid)]) of the suite's draft 2020-12 cases
    (its `optional/` ones left out: formats and such a validator need not check)."""
    home = os.path.join(os.path.expanduser("~"), ".cache", "tinyloop", "schema-corpus")
    tests = os.path.join(home, "tests", DRAFT)
    if not os.path.isdir(tests):
        os.makedirs(home, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", SDIST,
                        "-d", home], check=True)
        (sdist,) = glob.glob(os.path.join(home, "jsonschema-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                part = m.name.split("/json/tests/", 1)
                if len(part) == 2 and part[1].startswith(DRAFT + "/") and "/optional/" not in part[1] and m.isfile():
                    m.name = os.path.join("tests", part[1])
                    tar.extract(m, home, filter="data")
    out = []
    for path in sorted(glob.glob(os.path.join(tests, "*.json"))):
        for case in json.load(open(path)):
            out.append((os.path.basename(path), case["description"], case["schema"],
                        [(t["data"], t["valid"]) for t in case["tests"]]))
    return out


def accepts(g, ids: list, V: int, times: list) -> bool:
    """Does the mask let `ids` through, then allow the end? (each mask's fill timed into `times`)"""
    import numpy as np
    from tinyloop_jax.decoding import grammar as G

    m = g.matcher()
    for t in ids + [None]:
        t0 = time.perf_counter()
        mask = G.fill_masks([m], V)[0]
        times.append(time.perf_counter() - t0)
        if t is None:
            return bool(m.is_accepting())
        if not (int(np.uint32(mask[t // 32])) >> (t % 32)) & 1 or not m.consume_token(t):
            return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import _report
    import tinyloop_jax as tl

    tok = tl.load_tokenizer("smollm2")
    V = 49152
    cases = corpus()
    tally, reasons, compile_ms, times = collections.Counter(), collections.Counter(), [], []
    wrong = collections.defaultdict(list)
    for i, (file, what, schema, tests) in enumerate(cases):
        _report.progress(i, len(cases), "schemas")
        t0 = time.perf_counter()
        try:
            g = tl.Grammar.of({"type": "json_schema", "json_schema": {"name": "case", "schema": schema}}, tok, V)
        except ValueError as e:
            tally["schemas refused"] += 1
            reasons[str(e).rsplit("}: ", 1)[-1].split(",")[0][:70]] += 1  # (the message after the spec)
            continue
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        tally["schemas compiled"] += 1
        for data, valid in tests:
            ok = accepts(g, [int(x) for x in tok.encode(json.dumps(data, ensure_ascii=False), special=False)], V, times)
            key = ("valid" if valid else "invalid") + (" accepted" if ok else " rejected")
            tally[key] += 1
            if ok != valid:
                wrong[key].append(f"{file}: {what}")
    n = len(cases)
    us = sorted(t * 1e6 for t in times)
    valid = tally["valid accepted"] + tally["valid rejected"]
    invalid = tally["invalid accepted"] + tally["invalid rejected"]
    lines = [
        f"{n} schemas: {tally['schemas compiled']} compiled ({tally['schemas compiled'] / n:.0%}), "
        f"{tally['schemas refused']} refused with a ValueError naming the problem",
        f"valid instances accepted: {tally['valid accepted']} / {valid} ({tally['valid accepted'] / valid:.1%})",
        f"invalid instances rejected: {tally['invalid rejected']} / {invalid} "
        f"({tally['invalid rejected'] / invalid:.1%})",
        f"compile (Grammar.of, first time): median {statistics.median(compile_ms):.2f} ms, "
        f"max {max(compile_ms):.1f} ms",
        f"mask fill, one row: median {statistics.median(us):.1f} us, p90 {us[int(0.9 * len(us))]:.1f} us, "
        f"p99 {us[int(0.99 * len(us))]:.1f} us over {len(us)} masks"]
    print("\n".join(lines))
    print("refusals:", reasons.most_common(12))
    for key, where in wrong.items():
        print(f"{key} ({len(where)}):", collections.Counter(w.split(':')[0] for w in where).most_common(12))
    if args.no_write:
        return
    body = "\n".join([
        *_report.heading("Structured output on a schema corpus (issue 60, `scripts/bench_schema_corpus.py`)"),
        f"The JSON-Schema-Test-Suite's {DRAFT} cases (its required ones, as shipped in {SDIST}'s sdist), "
        "against SmolLM2's tokenizer: each instance `json.dumps`-ed (UTF-8 as a model writes it, not \\u "
        "escapes) and tokenized, accepted when every token is in the mask of what may follow and the end is "
        "allowed. A rejected valid instance: llguidance checks `format` (an annotation in draft 2020-12), "
        "matches numbers as written (1.0 is not the integer 1) and keeps properties in the schema's order.", "",
        *[f"- {x}" for x in lines],
        "- refused (most common reasons): " + "; ".join(f"{r} ({k})" for r, k in reasons.most_common(10)),
        *[f"- {key} by file: " + ", ".join(f"{f} {k}" for f, k in
                                           collections.Counter(w.split(':')[0] for w in where).most_common(10))
          for key, where in sorted(wrong.items())], ""])
    _report.write_section("bench_schema_corpus", body)


if __name__ == "__main__":
    main()
