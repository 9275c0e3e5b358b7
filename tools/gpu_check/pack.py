"""The carry folder a lent GPU machine needs for the check (``scripts/gpu-check.sh --pack``),
and its unpacking there.

That machine has Python 3.12, torch with CUDA 13, no vLLM, no network, and takes at most
64 MiB of carried files. What the check imports beyond torch and the repository: NIXL's
CUDA 13 build (``nixl-cu13``, cp312; its wheel is ~56 MiB, zip-deflated), NIXL's ``nixl``
meta package (which picks the build for the CUDA it finds), msgspec and numpy (cp312; torch
does not bring numpy) and opentelemetry-api with typing-extensions. Each wheel's files are repacked as an xz tar
(the CUDA build's shared libraries shrink to about a third), downloaded here from the
package index for CPython 3.12 on manylinux x86_64, at the NIXL version the venv here has.

On the machine, ``unpack`` puts the files of every wheel into a venv's site-packages
(``python3 -m venv --system-site-packages``: the system torch stays visible), with each
wheel's ``.data/purelib`` and ``platlib`` merged in, as an installer does; no pip needed.
kvpush itself is not installed there (it requires Python < 3.12): ``kvpush_path`` makes a
folder whose ``kvpush`` package is the repository's folders, for ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from importlib.metadata import version
from pathlib import Path

LIMIT_BYTES = 60 * 1024 * 1024
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The repository's folders that make the ``kvpush`` package (pyproject.toml's packages).
PACKAGE_FOLDERS = ("shared", "otel", "connector", "services", "tools")


def requirements() -> list[str]:
    nixl = version("nixl")
    return [f"nixl=={nixl}", f"nixl-cu13=={version('nixl-cu12')}", f"msgspec=={version('msgspec')}",
            f"opentelemetry-api=={version('opentelemetry-api')}", "typing-extensions", f"numpy=={version('numpy')}"]


def download(folder: Path, wanted: list[str]) -> list[Path]:
    """The cp312 manylinux wheels of ``wanted`` (no dependencies: each is named)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command + wanted, check=True, stdout=subprocess.DEVNULL)
    return sorted(folder.glob("*.whl"))


def repack(wheel: Path, into: Path) -> Path:
    """A wheel's files as ``<wheel name>.tar.xz``: its own deflate undone, xz over all."""
    out = into / (wheel.name + ".tar.xz")
    with zipfile.ZipFile(wheel) as archive, tarfile.open(out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for info in archive.infolist():
            if info.is_dir():
                continue
            data = archive.read(info)
            entry = tarfile.TarInfo(info.filename)
            entry.size = len(data)
            entry.mode = (info.external_attr >> 16) & 0o777 or 0o644
            tar.addfile(entry, io.BytesIO(data))
    return out


def pack(out: Path, progress=print) -> dict:
    """The carry folder at ``out`` (emptied first): the repacked wheels and a manifest."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as folder:
        wheels = download(Path(folder), requirements())
        packed = []
        for wheel in wheels:
            archive = repack(wheel, out)
            packed.append({"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size,
                           "packed": archive.name, "packed_bytes": archive.stat().st_size})
            progress(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB -> {archive.stat().st_size / 2**20:.1f} MiB")
    total = sum(p["packed_bytes"] for p in packed)
    manifest = {"wheels": packed, "total_bytes": total, "limit_bytes": LIMIT_BYTES}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if total > LIMIT_BYTES:
        raise SystemExit(f"the carry folder is {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB")
    progress(f"carry folder {out}: {total / 2**20:.1f} MiB of {LIMIT_BYTES / 2**20:.0f}")
    return manifest


def unpack(carry: Path, site_packages: Path) -> list[str]:
    """Every repacked wheel of ``carry`` into ``site_packages``, as an installer lays it out."""
    site_packages.mkdir(parents=True, exist_ok=True)
    done = []
    for archive in sorted(carry.glob("*.whl.tar.xz")):
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if ".." in parts or Path(member.name).is_absolute():
                    raise ValueError(f"{archive.name}: a path outside the package: {member.name}")
                if len(parts) > 2 and parts[0].endswith(".data"):
                    if parts[1] not in ("purelib", "platlib"):
                        continue  # scripts, headers, data: nothing the check imports
                    target = site_packages.joinpath(*parts[2:])
                else:
                    target = site_packages / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as source, open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink)
                target.chmod(member.mode | 0o600)
        done.append(archive.name)
    return done


def kvpush_path(repository: Path, into: Path) -> Path:
    """A folder holding a ``kvpush`` package made of the repository's folders (links), for
    ``PYTHONPATH``: kvpush is not installed on a Python it does not support."""
    package = into / "kvpush"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for name in ("__init__.py", "client.py"):
        (package / name).symlink_to(repository / "kvpush" / name)
    for folder in PACKAGE_FOLDERS:
        (package / folder).symlink_to(repository / folder, target_is_directory=True)
    return into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="build the carry folder here")
    packing.add_argument("--out", required=True)
    unpacking = sub.add_parser("unpack", help="on the device: the carry folder into a venv's site-packages")
    unpacking.add_argument("--carry", required=True)
    unpacking.add_argument("--site-packages", required=True)
    linking = sub.add_parser("kvpush-path", help="a folder for PYTHONPATH whose kvpush package is the repository")
    linking.add_argument("--repository", required=True)
    linking.add_argument("--into", required=True)
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(Path(args.out))
    elif args.command == "unpack":
        print("\n".join(unpack(Path(args.carry), Path(args.site_packages))))
    else:
        print(kvpush_path(Path(args.repository).resolve(), Path(args.into)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
