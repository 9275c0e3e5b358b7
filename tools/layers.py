"""The house's layering, measured from the code: import cycles and upward imports.

    python -m kvpush.tools.layers          # counts, then every cycle and upward import
    python -m kvpush.tools.layers --quiet  # the two counts only

Reads every module of the installed package's folders (``shared``, ``otel``, the client,
``connector``, ``services``, ``tools``) with ``ast``; nothing is imported or run. An import
counts wherever it stands, in a function too: a lazy import is still a dependency.

The layers, bottom-up; a module may import its own layer or a lower one:

    0  kvpush.shared     wire types, subjects, errors, permissions: the contracts
    0  kvpush.otel       tracing and metrics plumbing
    1  kvpush.client     the public Python API: a NATS client of the contracts
    2  kvpush.connector  the vLLM KV connector
    3  kvpush.services   scheduler, workers, gateway, CLI, launcher
    4  kvpush.tools      benchmark, fault rig, soak, hosts rig: never imported by the above

A cycle is a set of two or more modules that import each other, directly or through others
(a strongly connected component of the import graph).
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kvpush"
LAYERS = {"shared": 0, "otel": 0, "client": 1, "connector": 2, "services": 3, "tools": 4}
# where each part's files are, relative to the repository root
FOLDERS = {"shared": "shared", "otel": "otel", "client": "kvpush/client.py", "connector": "connector",
           "services": "services", "tools": "tools"}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (``kvpush.services.bus``)."""
    found: dict[str, Path] = {}
    for part, folder in FOLDERS.items():
        path = ROOT / folder
        if path.suffix == ".py":  # a part that is one module
            if path.exists():
                found[f"{PACKAGE}.{part}"] = path
            continue
        for file in sorted(path.rglob("*.py")):
            inner = [p for p in file.relative_to(path).with_suffix("").parts if p != "__init__"]
            found[".".join([PACKAGE, part, *inner])] = file
    return found


def _part(module: str) -> str:
    return module.split(".")[1]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module ``name`` names (itself, or the package it lies in), or None."""
    if not name.startswith(PACKAGE + ".") and name.split(".")[0] in LAYERS:
        name = f"{PACKAGE}.{name}"  # an import by the old top-level name still counts
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(known: dict[str, Path], bare: list[tuple[str, str]] | None = None) -> dict[str, set[str]]:
    """Each module's project imports, as module names. An import that names a part by its
    folder alone (``from services import ...``: it would load a second copy of the module,
    from the checkout rather than the package) is also added to ``bare``."""
    graph: dict[str, set[str]] = {}
    for module, file in known.items():
        targets: set[str] = set()
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                names = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            if bare is not None and names[-1].split(".")[0] in LAYERS:
                bare.append((module, names[-1]))
            for name in names:
                target = _resolve(name, known)
                if target and target != module:
                    targets.add(target)
        # "from pkg import mod" names both pkg and pkg.mod: keep the most specific only
        graph[module] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a module to one in a higher layer."""
    return sorted((source, target) for source, targets in graph.items() for target in targets
                  if LAYERS[_part(target)] > LAYERS[_part(source)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="the two counts only")
    args = parser.parse_args(argv)
    bare: list[tuple[str, str]] = []
    graph = imports(modules(), bare)
    found_cycles, found_upward = cycles(graph), upward(graph)
    print(f"modules: {len(graph)}  imports: {sum(map(len, graph.values()))}")
    print(f"cycles: {len(found_cycles)}")
    print(f"upward imports: {len(found_upward)}")
    print(f"imports by a bare folder name: {len(bare)}")
    if not args.quiet:
        for component in found_cycles:
            print("cycle:", " <-> ".join(component))
        for source, target in found_upward:
            print(f"upward: {source} -> {target}")
        for source, target in bare:
            print(f"bare: {source} imports {target}")
    return 1 if found_cycles or found_upward or bare else 0


if __name__ == "__main__":
    sys.exit(main())
