"""The ``kvpush`` command is built in layers: the services never import tools/; the
benchmarks and the soak add their commands through entry points, and parsing the command
line imports none of what a command runs."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from kvpush.services.cli import commands, main
from kvpush.services.cli.parsers import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DECLARED = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][commands.ENTRY_POINTS]


def _imported(file: Path) -> set[str]:
    """Every module ``file`` imports, at module level or in a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", ["shared", "otel", "connector", "services"])
def test_no_layer_below_the_tools_imports_them(layer):
    upward = {f"{file.relative_to(ROOT)}: {name}" for file in (ROOT / layer).rglob("*.py")
              for name in _imported(file) if name == "tools" or name.startswith("tools.")}
    assert not upward


def test_every_declared_command_is_installed_and_adds_itself():
    assert set(commands.installed()) == set(DECLARED), "re-run the install (scripts/setup.sh) after pyproject.toml"
    parser = main.build_parser()
    for name in DECLARED:
        args = parser.parse_args([name])
        assert args.command == name and callable(args.func)


def test_the_help_lists_every_command_in_its_place():
    sub = next(action for action in main.build_parser()._actions if action.dest == "command")
    assert list(sub.choices) == list(main.LISTED)
    assert set(main.LISTED) == set(COMMANDS) | set(DECLARED)


def test_a_command_whose_package_is_missing_is_left_out(monkeypatch):
    ghost = EntryPoint(name="ghost", value="kvpush_no_such_package.cli:register", group=commands.ENTRY_POINTS)
    real = EntryPoint(name="soak", value="kvpush.tools.reliability.cli:register_soak", group=commands.ENTRY_POINTS)
    monkeypatch.setattr(commands, "entry_points", lambda group: [ghost, real] if group == commands.ENTRY_POINTS else [])
    parser = main.build_parser()
    sub = next(action for action in parser._actions if action.dest == "command")
    assert "ghost" not in sub.choices and "soak" in sub.choices and "bench" not in sub.choices
    assert parser.parse_args(["up"]).command == "up"


def test_without_any_tool_the_services_commands_remain(monkeypatch):
    monkeypatch.setattr(commands, "entry_points", lambda group: [])
    parser = main.build_parser()
    assert parser.parse_args(["worker", "--role", "decode"]).command == "worker"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench"])


def test_a_lazy_command_imports_its_module_when_it_runs():
    run = commands.lazy("kvpush.services.cli.tools:cmd_trace")
    assert run.__name__ == "cmd_trace"
    code = ("import sys; from kvpush.services.cli.commands import lazy; lazy('kvpush.services.cli.tools:cmd_trace'); "
            "assert 'kvpush.services.cli.tools' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_parsing_the_command_line_imports_no_engine_service_or_tool():
    code = ("import sys; from kvpush.services.cli.main import build_parser; "
            "[build_parser().parse_args(argv) for argv in (['status'], ['bench'], ['worker', '--role', 'decode'])]; "
            "heavy = {'torch', 'vllm', 'nats', 'fastapi', 'kvpush.services.cli.serve', 'kvpush.tools.bench.run', "
            "'kvpush.tools.bench.scheduler_rate', 'kvpush.tools.reliability.soak'} & set(sys.modules); "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
