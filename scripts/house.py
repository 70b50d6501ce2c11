"""Count issue 59's structural targets in the package: jit sites outside model/ and native/,
files over 450 lines, import circles between modules. Prints a markdown table.

    python scripts/house.py
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tinyloop_jax"
MAX_LINES = 450


def modules() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    """Module name (a package by its own name) -> (file, syntax tree)."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (p, ast.parse(p.read_text()))
    return out


def jit_sites(name: str, tree: ast.Module) -> list[int]:
    """Lines that make a jitted program: a `jax.jit(...)` call, `partial(jax.jit, ...)`, `@jax.jit`;
    a table of programs jitted in a loop (`JIT_OPTIONS = dict(name=options, ...)`, made by a
    function `programs`) counts each entry."""
    out, table = [], [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "programs"]
    inside = {id(n) for f in table for n in ast.walk(f)}  # (the table's loop: its entries are counted)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "jit" and getattr(node.value, "id", None) == "jax"
                and id(node) not in inside):
            out.append(node.lineno)
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "JIT_OPTIONS" for t in node.targets)
                and isinstance(node.value, ast.Call)):
            out.extend(kw.value.lineno * 1000 + i for i, kw in enumerate(node.value.keywords))
    return sorted(set(out))


def imports(name: str, path: pathlib.Path, tree: ast.Module, known: set) -> set[str]:
    """The package modules `name` imports anywhere (a function's lazy import and a type-only one
    count: each is a dependency)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def circles(graph: dict[str, set]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main() -> None:
    mods = modules()
    graph = {m: imports(m, p, t, set(mods)) for m, (p, t) in mods.items()}
    sites = {m: jit_sites(m, t) for m, (p, t) in mods.items()}
    outside = {m: v for m, v in sites.items() if v and not m.startswith(("tinyloop_jax.model", "tinyloop_jax.native"))}
    long = {m: len(p.read_text().splitlines()) for m, (p, t) in mods.items()}
    long = {m: n for m, n in sorted(long.items(), key=lambda kv: -kv[1]) if n > MAX_LINES}
    rings = circles(graph)
    print("| target | count | where |\n|---|---|---|")
    print(f"| jit sites outside model/ and native/ (<= 12) | {sum(len(v) for v in outside.values())} | "
          + ", ".join(f"{m.split('.', 1)[1]} {len(v)}" for m, v in outside.items()) + " |")
    print(f"| files over {MAX_LINES} lines (0) | {len(long)} | "
          + ", ".join(f"{m.split('.', 1)[1]} {n}" for m, n in long.items()) + " |")
    print(f"| import circles (0) | {len(rings)} | " + "; ".join(" <-> ".join(r) for r in rings) + " |")


if __name__ == "__main__":
    main()
