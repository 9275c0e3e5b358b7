"""The ``kvpush`` command: one parser, to which each command adds its own subcommand:
the services' own (``kvpush.services.cli.parsers``) and those other installed packages add
(``kvpush.services.cli.commands``: the benchmarks and the soak in tools/)."""

from __future__ import annotations

import argparse
import sys

from kvpush.services.cli import commands, parsers
from kvpush.shared.nats_security import NatsConfigError, connect_options, export_arguments

# The order ``kvpush --help`` lists the commands in; any other comes after these, by name.
LISTED = ("model", "up", "demo", "scheduler", "gateway", "worker", "generate", "cancel", "bench", "soak",
          "bench-multiturn", "bench-scheduler", "bench-transfer", "conformance", "status", "nats-config", "trace", "explain")


def _listed_at(name: str) -> tuple[int, str]:
    return (LISTED.index(name) if name in LISTED else len(LISTED), name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpush", description="Disaggregated LLM serving with pushed KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    registers = {**commands.installed(), **parsers.COMMANDS}  # a service's command is never replaced
    for name in sorted(registers, key=_listed_at):
        registers[name](sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    export_arguments(args)  # children (vLLM's engine core, the stack's services) read them from there
    try:
        connect_options()
    except NatsConfigError as exc:
        print(f"kvpush: {exc}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
