"""kvpush on three "hosts" of one machine (tools/hosts/network.py): a three-server NATS
cluster with JetStream, one server per host; the schedulers and the gateway on h1, the
prefill worker on h2, the decode worker on h3. NIXL is forced onto UCX over TCP
(``UCX_TLS=tcp`` on each host's ``eth0``: no shared memory, no CMA), and tc counts what
prefill and decode send each other outside NATS, so a test can show the KV crossed the
link, and cut it.

It is the fault rig (tools/reliability/fault_rig.py) with its NATS and its services placed
elsewhere: the same identities, mutual TLS (the server certificate names the hosts'
addresses), short leases and deadlines, the same watchers and block accounting. The test
itself runs in the root namespace, which the network joins as 198.18.0.254. Root only.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.services.launch.natsd import server_binary, terminate
from kvpush.services.launch.stack import _die_with_parent
from kvpush.shared.permissions import literal_password, render_config
from kvpush.tools import dev_certs
from kvpush.tools.hosts.network import UCX_ON_ETH0, Host, Network
from kvpush.tools.reliability.fault_rig import IDENTITIES, TLS_FILES, FaultRig

CLUSTER = "kvpush"
CLIENT_PORT, ROUTE_PORT, MONITOR_PORT = 4222, 6222, 8222
HOSTS = {"h1": 1, "h2": 2, "h3": 3}
# Where each of the stack's services runs (child name or role -> host).
PLACEMENT = {"scheduler": "h1", "gateway": "h1", "prefill": "h2", "decode": "h3"}
# What a multi-host deployment sets: the KV over TCP on the host's own interface, and
# JetStream state replicated on all three servers.
MULTI_HOST_ENV = {**UCX_ON_ETH0, "KVPUSH_JETSTREAM_REPLICAS": "3"}


@dataclass
class NatsMember:
    host: Host
    name: str
    config: Path
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host.address}:{CLIENT_PORT}"

    def monitor(self, endpoint: str) -> dict:
        with urllib.request.urlopen(f"http://{self.host.address}:{MONITOR_PORT}/{endpoint}", timeout=2) as reply:
            return json.loads(reply.read())

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class NatsCluster:
    """Three nats-servers, one per host, routed to each other, JetStream on each."""

    def __init__(self, hosts: list[Host], folder: Path):
        self.folder = folder
        routes = ", ".join(f'"nats://{host.address}:{ROUTE_PORT}"' for host in hosts)
        self.members: list[NatsMember] = []
        for host in hosts:
            name = f"nats-{host.name}"
            store = folder / name / "store"
            store.mkdir(parents=True, exist_ok=True)
            extra = "\n".join([
                f'server_name: "{name}"',
                f'http: "{host.address}:{MONITOR_PORT}"',
                f'jetstream {{ store_dir: "{store}" }}',
                f'cluster {{ name: "{CLUSTER}", listen: "{host.address}:{ROUTE_PORT}", routes: [{routes}] }}',
            ])
            config = folder / f"{name}.conf"  # beside certs/, which the TLS paths name
            config.write_text(render_config(IDENTITIES, literal_password, tls=TLS_FILES, port=CLIENT_PORT,
                                            listen=host.address, extra=extra))
            config.chmod(0o600)
            self.members.append(NatsMember(host, name, config, log=folder / f"{name}.log"))
        self.killed: set[str] = set()

    @property
    def url(self) -> str:
        """Every member, as services take it (``--nats-url``)."""
        return ",".join(member.url for member in self.members)

    def start(self, timeout: float = 60.0) -> "NatsCluster":
        for member in self.members:
            self._launch(member)
        self.wait_healthy(timeout)
        return self

    def _launch(self, member: NatsMember) -> None:
        out = open(member.log, "ab")
        member.process = subprocess.Popen([*member.host.exec_prefix(), server_binary(), "-c", str(member.config)],
                                          cwd=self.folder, stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=_die_with_parent)
        out.close()

    def member_on(self, host_name: str) -> NatsMember:
        return next(member for member in self.members if member.host.name == host_name)

    def kill(self, member: NatsMember) -> None:
        """kill -9 one server (its host's NATS is gone; the host stays)."""
        member.process.send_signal(signal.SIGKILL)
        member.process.wait()
        self.killed.add(member.name)

    def restart(self, member: NatsMember, timeout: float = 60.0) -> None:
        """Start it again with the same store; return once the cluster is whole again."""
        self._launch(member)
        self.killed.discard(member.name)
        self.wait_healthy(timeout)

    def healthy(self) -> str | None:
        """None when every member runs, routes to the other two and its JetStream is
        current (``/healthz``); else what is missing."""
        for member in self.members:
            if not member.alive():
                return f"{member.name} is not running"
            try:
                routes = member.monitor("routez")
                health = member.monitor("healthz")
            except OSError as exc:
                return f"{member.name} does not answer its monitor port: {exc}"
            peers = {route.get("remote_name") for route in routes.get("routes", [])}
            if len(peers) < len(self.members) - 1:
                return f"{member.name} routes to {sorted(p for p in peers if p)} only"
            if health.get("status") != "ok":
                return f"{member.name}: {health}"
        return None

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (missing := self.healthy()) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the NATS cluster did not form within {timeout} s: {missing}; "
                                   f"{self.log_tails()}")
            time.sleep(0.25)

    def leader_of(self, stream: str) -> NatsMember:
        """The member leading a JetStream stream (a KV bucket's is ``KV_<bucket>``)."""
        for member in self.members:
            if not member.alive():
                continue
            report = member.monitor("jsz?accounts=true&streams=true")
            for account in report.get("account_details", []):
                for detail in account.get("stream_detail", []):
                    leader = detail.get("cluster", {}).get("leader")
                    if detail.get("name") == stream and leader:
                        return next(m for m in self.members if m.name == leader)
        raise LookupError(f"no member leads stream {stream}")

    def connections(self, member: NatsMember) -> list[str]:
        """The names of the clients connected to ``member`` (services name their connections)."""
        return [conn.get("name", "") for conn in member.monitor("connz?limit=1024").get("connections", [])]

    def alive(self) -> bool:
        return all(member.alive() for member in self.members if member.name not in self.killed)

    def log_tails(self, chars: int = 800) -> str:
        return " | ".join(f"{m.name}: {m.log.read_text(errors='replace')[-chars:]}" for m in self.members
                          if m.log is not None and m.log.exists())

    def stop(self) -> None:
        for member in self.members:
            if member.process is not None:
                terminate(member.process, timeout=10)


@dataclass
class MultiHostRig(FaultRig):
    network: Network | None = None
    cluster: NatsCluster | None = field(default=None, repr=False)

    @property
    def prefill_host(self) -> Host:
        return self.network.hosts[PLACEMENT["prefill"]]

    @property
    def decode_host(self) -> Host:
        return self.network.hosts[PLACEMENT["decode"]]

    async def start(self, extra_env: dict[str, str] | None = None) -> "MultiHostRig":
        return await super().start({**MULTI_HOST_ENV, **(extra_env or {})})

    def start_nats(self) -> NatsCluster:
        self.network = Network().start()
        hosts = [self.network.add_host(name, number) for name, number in HOSTS.items()]
        self.prefill_host.watch(self.decode_host)
        self.decode_host.watch(self.prefill_host)
        folder = self.folder / "nats"
        folder.mkdir(parents=True, exist_ok=True)
        self.certs = dev_certs.generate(folder / "certs", server_ips=tuple(host.address for host in hosts))
        self.cluster = NatsCluster(hosts, folder).start()
        return self.cluster

    def stack_options(self) -> dict:
        h1 = self.network.hosts[PLACEMENT["gateway"]]
        return {
            "launchers": {role: self.network.hosts[host].exec_prefix() for role, host in PLACEMENT.items()},
            "gateway_port": 0, "gateway_host": h1.address,
            "metrics": False,  # the services' /metrics would listen inside their hosts' namespaces
            "role_env": {"gateway": self.identity_env("client-0")},  # a client of kvpush like any other
        }

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            if self.network is not None:
                self.network.stop()


@contextlib.asynccontextmanager
async def running_multi_host_rig(folder: Path, model: str, max_model_len: int, extra_env: dict[str, str] | None = None):
    """A started rig for a test module; on a failed start its services' and servers' logs go to stderr."""
    rig = MultiHostRig(folder, model, max_model_len, extra_env=extra_env or {})
    try:
        await rig.start()
        yield rig
    except BaseException:
        for log in sorted([*(folder / "logs").glob("*.log"), *(folder / "nats").glob("*.log")]):
            sys.stderr.write(f"----- {log.name}\n{log.read_text(errors='replace')[-3000:]}\n")
        raise
    finally:
        await rig.stop()
