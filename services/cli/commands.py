"""How a command joins ``kvpush``: a ``register(subparsers)`` function that adds one
subcommand, its function named by ``lazy`` so that parsing the command line (and
``--help``) imports no service, engine or tool.

The services' own commands are in ``kvpush.services.cli.parsers``. A package above the services
(the benchmarks and the soak in tools/) adds its commands through the ``kvpush.commands``
entry points of its distribution (pyproject.toml), one per command, named as the
command::

    [project.entry-points."kvpush.commands"]
    bench = "kvpush.tools.bench.cli:register_bench"

so that the services never import it, and ``kvpush up`` works where it is not installed.
"""

from __future__ import annotations

import argparse
import importlib
from importlib.metadata import entry_points
from typing import Callable

ENTRY_POINTS = "kvpush.commands"

Command = Callable[[argparse.Namespace], int]
Register = Callable[[argparse._SubParsersAction], None]


def lazy(ref: str) -> Command:
    """The command function ``"module:function"``, imported when the command runs."""
    module, _, function = ref.partition(":")

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    run.__qualname__ = run.__name__ = function
    return run


def installed() -> dict[str, Register]:
    """Each command other installed packages add, by name. One whose module is not there
    (an entry point left from an install of more than this copy holds) is left out."""
    found: dict[str, Register] = {}
    for entry in entry_points(group=ENTRY_POINTS):
        if entry.name in found:
            continue
        try:
            found[entry.name] = entry.load()
        except ImportError:
            continue
    return found
