"""How much of a folder is pure: the share of its lines in modules that import no I/O
library (NATS, vLLM, asyncio, OpenTelemetry, an HTTP library, NIXL, torch), directly or
through a kvpush module that does.

    python -m kvpush.tools.purity services/worker services/scheduler

Reads the modules with ``ast``, as ``kvpush.tools.layers`` does: nothing is imported or
run, and an import inside a function counts (a lazy import is still a dependency), unless
``--module-level``.
``kvpush.otel`` counts as OpenTelemetry. A folder's own files only, not its subfolders.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from kvpush.tools.layers import ROOT, imports, modules

IMPURE = {"nats", "vllm", "asyncio", "opentelemetry", "httpx", "aiohttp", "fastapi", "uvicorn", "starlette",
          "nixl", "torch"}
IMPURE_MODULES = ("kvpush.otel",)


def _libraries(file: Path, lazy: bool = True) -> set[str]:
    """The top-level names of what a module imports (``from a.b import c``: ``a``);
    without ``lazy``, only its imports at module level (those run when it is imported)."""
    names: set[str] = set()
    tree = ast.parse(file.read_text(), str(file))
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def impure_modules(lazy: bool = True) -> set[str]:
    """The project's modules that reach an I/O library, directly or through another module
    (without ``lazy``: counting only the I/O libraries each module imports at module level)."""
    known = modules()
    graph = imports(known)
    impure = {m for m, file in known.items()
              if _libraries(file, lazy) & IMPURE or m.startswith(IMPURE_MODULES)}
    grew = True
    while grew:
        grew = False
        for module, targets in graph.items():
            if module not in impure and targets & impure:
                impure.add(module)
                grew = True
    return impure


def pure_share(folder: str, impure: set[str]) -> tuple[int, int, list[tuple[str, int, bool]]]:
    """(pure lines, all lines, each module's (file, lines, pure)) of a folder's own modules."""
    rows = []
    for module, file in sorted(modules().items(), key=lambda item: str(item[1])):
        if file.parent != (ROOT / folder).resolve() or file.name == "__init__.py":
            continue
        rows.append((str(file.relative_to(ROOT)), len(file.read_text().splitlines()), module not in impure))
    return sum(n for _, n, pure in rows if pure), sum(n for _, n, _ in rows), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="folders relative to the repository root")
    parser.add_argument("--quiet", action="store_true", help="the shares only")
    parser.add_argument("--module-level", action="store_true",
                        help="count an I/O library only where a module imports it at module level (not in a function)")
    args = parser.parse_args(argv)
    impure = impure_modules(lazy=not args.module_level)
    for folder in args.folders:
        pure, total, rows = pure_share(folder.rstrip("/"), impure)
        print(f"{folder}: {pure} of {total} lines pure ({100 * pure / max(total, 1):.0f}%)")
        if not args.quiet:
            for file, lines, is_pure in rows:
                print(f"  {'pure  ' if is_pure else 'impure'} {lines:5d} {file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
