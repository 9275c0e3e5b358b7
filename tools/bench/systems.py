"""The systems ``kvpush bench`` compares, each started fresh and stopped whole.

- ``KvpushSystem``: ``kvpush up`` as a user runs it (NATS, scheduler, workers, the OpenAI
  gateway). Its two variants, push and pull, share the stack: the transfer mode is a field
  of the request (``transfer_mode``).
- ``VllmServeSystem``: vLLM's disaggregated serving as vLLM's docs run it: one ``vllm
  serve`` per engine with ``NixlConnector`` or ``NixlPushConnector`` (roles: ``kv_role``)
  behind the proxy of that connector's example (``vllm_proxy``).

Both speak the same OpenAI API, so one client (``vllm bench serve``) drives them all.
``binding`` places each engine's OpenMP threads, one core list per rank: ``auto`` leaves it
to vLLM (a lone ``vllm serve`` binds its engine to all cores but one, kept for its API
server; kvpush's workers get all of them; above TP 1 vLLM's ``auto`` wants a NUMA node per
rank, and kvpush's workers spread their ranks over the cores), ``split`` binds each rank to
a core of its own, the ranks of all engines counted in order (at TP 1, engine i on core i;
mod the cores there are), ``all`` binds every rank to every core and keeps none back.
``Topology`` gives each role's tensor parallelism (``--prefill-tp``, ``--decode-tp``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvpush.services.launch.natsd import free_port
from kvpush.services.launch.stack import Stack, answers
from kvpush.services.worker.cpu_binding import BIND_ENV
from kvpush.shared import connector_kinds
from kvpush.tools.emulation.link import UCX_OVER_TCP, EngineHosts

BINDINGS = ("auto", "split", "all")
KV_CACHE_GIB = "2"  # every engine of every system gets the same KV space


@dataclass(frozen=True)
class Topology:
    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1  # each prefill engine's tensor parallelism
    decode_tp: int = 1

    @property
    def label(self) -> str:
        """``1P1D``; with TP above 1 on either side, ``1P1D-tp2x1`` (prefill's TP, then decode's)."""
        shape = f"{self.prefill}P{self.decode}D"
        if (self.prefill_tp, self.decode_tp) == (1, 1):
            return shape
        return f"{shape}-tp{self.prefill_tp}x{self.decode_tp}"

    @property
    def engines(self) -> list[tuple[str, int, int]]:
        """(role, index within the role, TP) of each engine: the prefills first, then the decodes."""
        return [("prefill", i, self.prefill_tp) for i in range(self.prefill)] + \
               [("decode", i, self.decode_tp) for i in range(self.decode)]

    def tp_of(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp


def core_binding(binding: str, engine_index: int, topology: Topology = Topology()) -> dict[str, str]:
    """The environment that places engine ``engine_index`` of ``topology`` (prefills first,
    then decodes): one core list per rank of it, as vLLM takes them (``a|b``)."""
    if binding == "auto":
        return {}
    cores = os.cpu_count() or 1
    if binding == "split":
        return {BIND_ENV: "|".join(str(core % cores) for core in split_cores(topology, engine_index))}
    if binding == "all":  # every rank of every engine on every core, none kept back for vLLM's API server
        ranks = topology.engines[engine_index][2]
        return {BIND_ENV: "|".join([f"0-{cores - 1}"] * ranks), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    raise ValueError(f"binding must be one of {BINDINGS}, not {binding!r}")


def split_cores(topology: Topology, engine_index: int) -> list[int]:
    """``split``'s core of each rank of engine ``engine_index``, before wrapping around the
    machine's cores: the ranks of all engines counted in order (prefills, then decodes), rank
    k on core k. At TP 1, engine i on core i."""
    first = sum(tp for _, _, tp in topology.engines[:engine_index])
    return list(range(first, first + topology.engines[engine_index][2]))


def _wait_until_answers(urls: list[str], processes: list[tuple[str, subprocess.Popen]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = list(urls)
    while waiting:
        for name, process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode} before it was ready")
        waiting = [url for url in waiting if not answers(url)]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"not ready within {timeout:.0f} s: {', '.join(waiting)}")
        if waiting:
            time.sleep(1.0)


class KvpushSystem:
    name = "kvpush"
    variants = {f"kvpush-{mode}": {"transfer_mode": mode} for mode in ("push", "pull", "auto", "local")}

    def __init__(self, model: str, max_model_len: int, topology: Topology, binding: str, log_dir: Path,
                 otlp_endpoint: str, prefix_caching: str = "off", engine_env: dict[str, str] | None = None,
                 hosts: EngineHosts | None = None, block_size: int | None = None, max_num_seqs: int | None = None):
        """``prefix_caching`` off by default: the published push-vs-pull shape (vLLM's too, below).
        ``engine_env``: more for every process (the emulated GPUs' settings); ``hosts``: each
        worker on a host of its own, NIXL over UCX TCP between them (the emulated link)."""
        self.topology = topology
        self.binding = binding
        role_env = {f"{role}-{i}": core_binding(binding, index, topology)
                    for index, (role, i, _) in enumerate(topology.engines)}
        placement = {}
        if hosts is not None:
            placement = {"launchers": {name: hosts.launcher(name) for name in role_env},
                         "nats_host": hosts.root_address}
            role_env = {name: {**env, **UCX_OVER_TCP} for name, env in role_env.items()}
        self.stack = Stack(model, prefill=topology.prefill, decode=topology.decode, max_model_len=max_model_len,
                           prefill_tp=topology.prefill_tp, decode_tp=topology.decode_tp, block_size=block_size,
                           max_num_seqs=max_num_seqs,
                           log_dir=log_dir, gateway_port=0, role_env=role_env, prefix_caching=prefix_caching,
                           extra_env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_endpoint, "OTEL_METRICS_EXPORTER": "none",
                                      "KVPUSH_LOG_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
                                      **(engine_env or {})}, **placement)

    async def start(self, timeout: float = 600) -> None:
        self.stack.start()
        await self.stack.wait_ready(timeout=timeout)

    @property
    def base_url(self) -> str:
        return self.stack.gateway_url

    def processes(self) -> dict[str, int]:
        """Process name -> pid of each process whose tree the CPU accounting covers."""
        named = {name: process.pid for name, process in self.stack.children}
        if self.stack.nats_server is not None and self.stack.nats_server.process is not None:
            named["nats-server"] = self.stack.nats_server.process.pid
        return named

    def stop(self) -> None:
        self.stack.stop()


class VllmServeSystem:
    def __init__(self, variant: str, model: str, served_model_name: str, max_model_len: int, topology: Topology,
                 binding: str, log_dir: Path, prefix_caching: str = "off", engine_env: dict[str, str] | None = None,
                 hosts: EngineHosts | None = None, block_size: int | None = None,
                 kv_extra_config: dict | None = None, max_num_seqs: int | None = None):
        """``variant``: a kind of vLLM's own connector (``kvpush.shared.connector_kinds``);
        ``engine_env``: more for every engine (the emulated GPUs' settings); ``hosts``: each
        engine on a host of its own, NIXL over UCX TCP between them (the emulated link)."""
        kind = connector_kinds.of(variant)
        if kind.ours:
            raise ValueError(f"{variant!r} is not one of vLLM's own connectors")
        self.name = variant
        self.prefix_caching = prefix_caching
        self.variants = {variant: {}}
        self.connector = kind.vllm_connector
        (self.flow,) = kind.modes  # each of vLLM's does one: its proxy's flow
        self.model = model
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.topology = topology
        self.binding = binding
        self.log_dir = log_dir
        self.extra_env = dict(engine_env or {})
        self.hosts = hosts
        self.block_size = block_size  # None: vLLM's default for the platform
        self.max_num_seqs = max_num_seqs  # None: vLLM's default (128 on CPUs)
        self.kv_extra_config = kv_extra_config or {}  # the connector's kv_connector_extra_config (emulated waits)
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.proxy_port = 0

    def _spawn(self, name: str, args: list[str], env: dict[str, str], launcher: list[str] = ()) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_dir / f"{name}.log", "ab")
        process = subprocess.Popen([*launcher, sys.executable, "-m", *args], env={**os.environ, **env}, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append((name, process))
        return process

    def kv_role(self, role: str) -> str:
        """NixlConnector: ``kv_producer`` / ``kv_consumer``, as its docs ask (``kv_both`` is
        deprecated there). NixlPushConnector: ``kv_both``, as its demo runs it; with
        ``kv_consumer`` on decode, the prefill's handshake back to the decode timed out here
        and no WRITE was ever posted."""
        if self.flow == "push":
            return "kv_both"
        return "kv_producer" if role == "prefill" else "kv_consumer"

    def serve_command(self, role: str, port: int, engine_id: str, host: str = "127.0.0.1") -> list[str]:
        config = {"kv_connector": self.connector, "kv_role": self.kv_role(role),
                  "kv_buffer_device": "cpu", "engine_id": engine_id}
        if self.kv_extra_config:
            config["kv_connector_extra_config"] = self.kv_extra_config
        command = ["kvpush.tools.bench.vllm_cli", "serve", self.model, "--host", host, "--port", str(port),
                   "--served-model-name", self.served_model_name, "--kv-transfer-config", json.dumps(config),
                   "--enforce-eager", "--enable-prefix-caching" if self.prefix_caching == "on" else "--no-enable-prefix-caching",
                   "--dtype", "float32",
                   "--max-model-len", str(self.max_model_len)]
        if self.topology.tp_of(role) != 1:
            command += ["--tensor-parallel-size", str(self.topology.tp_of(role))]
        if self.block_size is not None:
            command += ["--block-size", str(self.block_size)]
        if self.max_num_seqs is not None:
            command += ["--max-num-seqs", str(self.max_num_seqs)]
        return command

    def engine_env(self, engine_index: int, side_channel: int, host: str = "127.0.0.1") -> dict[str, str]:
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
               "VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **core_binding(self.binding, engine_index, self.topology),
               **self.extra_env}
        if self.flow == "push":
            # The push proxy sends both legs at once, so decode knows prefill's request id only as
            # the proxy named it; prefill renews its lease on blocks decode has not received yet
            # only for heartbeats with its exact id, which the engine otherwise suffixes at random.
            env["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
        if host != "127.0.0.1":
            env.update(UCX_OVER_TCP)
        return env

    async def start(self, timeout: float = 600) -> None:
        import asyncio

        prefills, decodes, health = [], [], []
        for index, (role, i, _) in enumerate(self.topology.engines):
            port, side_channel = free_port(), free_port()  # free here; on a host of its own, free there too
            engine_id = f"{role}-{i}"
            host = self.hosts.address(engine_id) if self.hosts else "127.0.0.1"
            launcher = self.hosts.launcher(engine_id) if self.hosts else []
            self._spawn(engine_id, self.serve_command(role, port, engine_id, host),
                        self.engine_env(index, side_channel, host), launcher)
            health.append(f"http://{host}:{port}/health")
            if role == "prefill":
                prefills.append(f"{host}:{port}:{engine_id}:{side_channel}")
            else:
                decodes.append(f"{host}:{port}")
        self.proxy_port = free_port()
        self._spawn("proxy", self.proxy_command(prefills, decodes), {})
        health.append(f"{self.base_url}/healthcheck")
        await asyncio.to_thread(_wait_until_answers, health, self.children, timeout)

    def proxy_command(self, prefills: list[str], decodes: list[str]) -> list[str]:
        """The proxy in front of the engines (``vllm_proxy``): its flow, its port, the
        instances, and the prefills' TP, which a push decode leg names."""
        return ["kvpush.tools.bench.vllm_proxy", "--flow", self.flow, "--port", str(self.proxy_port),
                "--prefill", *prefills, "--decode", *decodes, "--prefill-tp", str(self.topology.prefill_tp)]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def processes(self) -> dict[str, int]:
        return {name: process.pid for name, process in self.children}

    def stop(self, timeout: float = 60.0) -> None:
        for _, process in self.children:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, process in self.children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.children.clear()
