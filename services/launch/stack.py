"""``kvpush up``: NATS (when no URL is given), a scheduler and the workers, as child processes."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats

from kvpush.services.launch.natsd import LocalNatsServer, free_port
from kvpush.services.worker.cpu_binding import BIND_ENV, Placement, engine_bindings
from kvpush.shared import settings
from kvpush.shared.nats_security import connect_options, error_logger, server_urls
from kvpush.client import scheduler_status

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Children get SIGTERM if ``kvpush up`` itself dies, so no engine is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Stack:
    def __init__(
        self,
        model: str,
        nats_url: str | None = None,
        prefill: int = 1,
        decode: int = 1,
        max_model_len: int = settings.MAX_MODEL_LEN,
        mode: str = settings.TRANSFER_MODE,
        connector: str = settings.CONNECTOR,
        prefix_caching: str = settings.PREFIX_CACHING,
        log_dir: Path | None = None,
        extra_env: dict[str, str] | None = None,
        role_env: dict[str, dict[str, str]] | None = None,
        schedulers: int = 1,
        gateway_port: int | None = None,
        gateway_host: str = "127.0.0.1",
        metrics: bool = False,
        launchers: dict[str, list[str]] | None = None,
        nats_host: str = "127.0.0.1",
        *,
        prefill_tp: int = 1,  # each prefill worker's engine's tensor parallelism
        decode_tp: int = 1,
        worker_tp: dict[str, int] | None = None,  # per worker name (decode-1, ...), over its role's
        block_size: int | None = None,  # every engine's tokens per KV block; None: vLLM's default
        max_num_seqs: int | None = None,  # every engine's; None: the worker's default
        placement: Placement = Placement.SPREAD,
    ):
        self.model = model
        self.nats_url = nats_url
        self.num_prefill = prefill
        self.num_decode = decode
        self.num_schedulers = schedulers
        self.gateway_port = gateway_port  # None: no gateway
        self.gateway_host = gateway_host  # the address it binds and clients use
        self.metrics = metrics  # each service serves /metrics on a port of its own
        self.metrics_targets: dict[str, list[str]] = {}  # child name -> host:port to scrape
        self.max_model_len = max_model_len
        self.mode = mode
        self.connector = connector
        self.prefix_caching = prefix_caching  # "on" or "off"
        self.log_dir = log_dir
        self.extra_env = extra_env or {}
        # Per worker name (prefill-0, ...), else per role (scheduler, prefill, decode, client): e.g. its NATS user.
        self.role_env = role_env or {}
        # Per child name, else per role: a command prefix that starts it elsewhere, e.g.
        # ["ip", "netns", "exec", "h2"] (the multi-host rig's "hosts").
        self.launchers = launchers or {}
        self.nats_host = nats_host  # where its own NATS listens (a launcher's hosts must reach it)
        self.tensor_parallel = {"prefill": prefill_tp, "decode": decode_tp}
        self.worker_tp = worker_tp or {}
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.placement = placement  # how engines above TP 1 share this machine's cores (cpu_binding)
        self.nats_server: LocalNatsServer | None = None
        self.children: list[tuple[str, subprocess.Popen]] = []

    def start(self) -> "Stack":
        if self.nats_url is None:
            port = settings.DEFAULT_NATS_PORT if _port_free(settings.DEFAULT_NATS_PORT) else free_port()
            self.nats_server = LocalNatsServer(port=port, host=self.nats_host).start()
            self.nats_url = self.nats_server.url
        common = ["--nats-url", self.nats_url, "--model", self.model, "--max-model-len", str(self.max_model_len)]
        for i in range(self.num_schedulers):
            self.spawn_scheduler("scheduler" if i == 0 else f"scheduler-{i}")
        if self.gateway_port is not None:
            if self.gateway_port == 0 or not _port_free(self.gateway_port):
                self.gateway_port = free_port()
            self._spawn("gateway", "gateway", ["gateway", *common, "--host", self.gateway_host,
                                               "--port", str(self.gateway_port)])
        for i in range(self.num_prefill):
            self.spawn_worker("prefill", f"prefill-{i}")
        for i in range(self.num_decode):
            self.spawn_worker("decode", f"decode-{i}")
        return self

    @property
    def gateway_url(self) -> str | None:
        return f"http://{self.gateway_host}:{self.gateway_port}" if self.gateway_port is not None else None

    def spawn_scheduler(self, name: str = "scheduler") -> subprocess.Popen:
        """Start a scheduler (one more, or one again after a crash); they share the load."""
        common = ["--nats-url", self.nats_url, "--model", self.model, "--max-model-len", str(self.max_model_len)]
        args = ["scheduler", *common, "--mode", self.mode]
        if self.nats_server is not None and "KVPUSH_NATS_USER" not in self._env("scheduler", name):
            args += ["--scheduler-id", name]
        return self._spawn("scheduler", name, args)

    def spawn_worker(self, role: str, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start one more worker (a replacement after a crash, say); it joins on its own."""
        return self._spawn(role, name, self.worker_args(role, name), {**self.worker_binding(role, name), **(env or {})})

    def worker_args(self, role: str, name: str) -> list[str]:
        """The command line of the worker ``name`` (prefill-0, ...) of ``role``."""
        common = ["--nats-url", self.nats_url, "--model", self.model, "--max-model-len", str(self.max_model_len)]
        args = ["worker", "--role", role, *common, "--connector", self.connector,
                "--prefix-caching", self.prefix_caching]
        if self.tp_of(role, name) != 1:
            args += ["--tensor-parallel-size", str(self.tp_of(role, name))]
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.nats_server is not None and "KVPUSH_NATS_USER" not in self._env(role, name):
            # Our own NATS: nobody else's workers can share these names. (With per-worker
            # NATS users the user is the id; on a shared server without, each gets a new one.)
            args += ["--worker-id", name]
        return args

    def tp_of(self, role: str, name: str) -> int:
        """The tensor parallelism of worker ``name``'s engine: its own, else its role's."""
        return self.worker_tp.get(name, self.tensor_parallel[role])

    def worker_binding(self, role: str, name: str) -> dict[str, str]:
        """Where the ranks of worker ``name``'s engine run, when it has more than one and
        nothing in its environment says: every worker's engine on this machine's cores, as
        ``placement`` shares them (``cpu_binding.engine_bindings``). At TP 1, nothing: vLLM's
        own binding of one rank stands."""
        if self.tp_of(role, name) == 1 or BIND_ENV in self._env(role, name):
            return {}
        engines = {**{f"prefill-{i}": "prefill" for i in range(self.num_prefill)},
                   **{f"decode-{i}": "decode" for i in range(self.num_decode)}}
        engines.setdefault(name, role)  # a worker beyond the first ones takes the next place
        bindings = engine_bindings(sorted(os.sched_getaffinity(0)), [self.tp_of(r, n) for n, r in engines.items()],
                                   self.placement)
        return {BIND_ENV: bindings[list(engines).index(name)]}

    def _env(self, role: str, name: str = "") -> dict[str, str]:
        return {**os.environ, **self.extra_env, **self.role_env.get(name, self.role_env.get(role, {}))}

    def _spawn(self, role: str, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        env = {**self._env(role, name), **(env or {})}
        if self.metrics and role != "gateway":  # the gateway's /metrics is on its own HTTP port
            port = _free_port_pair()
            env["KVPUSH_METRICS_PORT"] = str(port)
            self.metrics_targets[name] = [f"127.0.0.1:{port}"]
            if role in ("prefill", "decode"):
                self.metrics_targets[name].append(f"127.0.0.1:{port + 1}")  # its engine core
        elif role == "gateway":
            self.metrics_targets[name] = [f"127.0.0.1:{self.gateway_port}"]
        out = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")
        launcher = self.launchers.get(name, self.launchers.get(role, []))
        process = subprocess.Popen(
            [*launcher, sys.executable, "-m", "kvpush.services.cli.main", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=_die_with_parent,
        )
        self.children.append((name, process))
        return process

    async def wait_ready(self, timeout: float = 300.0, progress=None) -> None:
        """Return once the scheduler routes to every worker; raise if a child died."""
        nc = await nats.connect(server_urls(self.nats_url), error_cb=error_logger("kvpush-up"),
                                **connect_options(self._env("client")))
        try:
            deadline = time.monotonic() + timeout
            last = None
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    status = await scheduler_status(nc, timeout=1.0)
                    counts = (len(status.prefill_workers), len(status.decode_workers))
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    counts = None
                if counts != last and progress is not None:
                    progress(
                        "waiting for the scheduler"
                        if counts is None
                        else f"workers ready: prefill {counts[0]}/{self.num_prefill}, decode {counts[1]}/{self.num_decode}"
                    )
                last = counts
                if counts is not None and counts[0] >= self.num_prefill and counts[1] >= self.num_decode:
                    if self.gateway_url is None or await asyncio.to_thread(answers, self.gateway_url + "/health"):
                        return
                await asyncio.sleep(0.5)
            raise TimeoutError(f"the stack was not ready within {timeout} s")
        finally:
            await nc.close()

    def check_alive(self) -> None:
        for name, process in self.children:
            code = process.poll()
            if code is not None:
                raise RuntimeError(f"{name} exited with code {code} before the stack was ready")

    def stop(self, timeout: float = 60.0) -> None:
        for _, process in self.children:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, process in self.children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.children.clear()
        if self.nats_server is not None:
            self.nats_server.stop()
            self.nats_server = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 within a second."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1.0) as reply:
            return reply.status == 200
    except OSError:
        return False


def _free_port_pair() -> int:
    """A free port whose next port is free too (a worker and its engine core)."""
    while True:
        port = free_port()
        if port < 65535 and _port_free(port + 1):
            return port


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
