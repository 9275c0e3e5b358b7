"""What is installed is what the checkout has: every package is in pyproject.toml and the
Dockerfile, and the installed ``kvpush`` command works outside the checkout."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")


def test_every_top_level_package_is_installed_and_copied_into_the_image():
    assert {"services", "shared", "connector", "otel", "tools"} <= set(PACKAGES)
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in PACKAGES:
        assert f"{package}*" in include, package
        assert f"COPY {package} ./{package}" in dockerfile, package


def test_every_subpackage_has_an_init():
    for package in PACKAGES:
        for folder in (ROOT / package).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
                assert (folder / "__init__.py").exists(), folder


def test_the_installed_command_runs_outside_the_checkout(tmp_path):
    kvpush = Path(sys.executable).parent / "kvpush"
    for argv in (["--help"], ["worker", "--help"], ["status", "--help"]):
        result = subprocess.run([str(kvpush), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "usage: kvpush" in result.stdout
    # A module the stack starts as a child process, resolved from outside the checkout too.
    result = subprocess.run([sys.executable, "-m", "services.cli.main", "trace", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
