"""What is installed is what the checkout has, under one package: every folder is in
pyproject.toml and the Dockerfile, the wheel puts nothing but ``kvpush`` at the top of
site-packages, the installed ``kvpush`` command works outside the checkout, and the layering
has no cycle and no upward import."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from kvpush.tools import layers

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("shared", "otel", "connector", "services", "tools")  # the design card's folders
GENERIC = {"services", "shared", "tools", "connector", "otel"}


def test_every_folder_is_a_package_of_kvpush_and_copied_into_the_image():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"kvpush"} | {"kvpush." + ".".join(init.parent.relative_to(ROOT).parts)
                            for part in PARTS for init in (ROOT / part).rglob("__init__.py")}
    assert set(config["packages"]) == folders
    assert config["package-dir"] == {"kvpush": "kvpush", **{f"kvpush.{part}": part for part in PARTS}}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in ("kvpush", *PARTS):
        assert f"COPY {folder} ./{folder}" in dockerfile, folder


def test_every_subpackage_has_an_init():
    for part in PARTS:
        for folder in (ROOT / part).rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
                assert (folder / "__init__.py").exists(), folder


def test_the_layering_has_no_cycle_no_upward_import_and_no_bare_folder_import(capsys):
    assert layers.main(["--quiet"]) == 0, capsys.readouterr().out
    assert "cycles: 0\nupward imports: 0\nimports by a bare folder name: 0" in capsys.readouterr().out


def test_the_wheel_holds_one_top_level_package_and_its_client_imports_from_it(tmp_path):
    """Built as pip builds it for users; unpacked as pip installs it; imported from outside
    the checkout, ahead of the editable install this checkout has."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    wheel, = tmp_path.glob("kvpush-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    top = {name.split("/")[0] for name in names}
    assert not top & GENERIC, top
    assert {t for t in top if not t.endswith(".dist-info")} == {"kvpush"}
    assert "kvpush/client.py" in names and "kvpush/services/scheduler/service.py" in names
    site = tmp_path / "site"
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import kvpush.client, kvpush.services.cli.main; "
             "print(kvpush.client.__file__)")
    result = subprocess.run([sys.executable, "-I", "-c", probe, str(site)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).is_relative_to(site)


def test_the_installed_command_runs_outside_the_checkout(tmp_path):
    kvpush = Path(sys.executable).parent / "kvpush"
    for argv in (["--help"], ["worker", "--help"], ["status", "--help"]):
        result = subprocess.run([str(kvpush), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "usage: kvpush" in result.stdout
    # A module the stack starts as a child process, resolved from outside the checkout too.
    result = subprocess.run([sys.executable, "-m", "kvpush.services.cli.main", "trace", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
