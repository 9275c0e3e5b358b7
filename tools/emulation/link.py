"""A link like a GPU cluster's between the engines: each engine on a host of its own (a
network namespace of tools/hosts/network.py), NIXL over UCX TCP on its ``eth0``, and what each
prefill sends each decode (and back) shaped with tc to the rate that
:func:`~kvpush.tools.emulation.time_model.shaped_link_rate` gives (:class:`EngineHosts`);
and a probe that measures what one NIXL WRITE gets through such a link (:func:`measure`).

``python -m kvpush.tools.emulation.link target|initiator --dir D --mib N`` runs one side of the
probe (each side in its host's namespace); the two meet through files in ``D``, a folder both
see (namespaces share the file system): the target writes its agent's metadata and its
buffer's descriptors, the initiator WRITEs the whole buffer twice (the first pays connection
setup and page faults) and writes the second's time to ``result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvpush.tools.hosts.network import OPERATOR, SUBNET_PREFIX, UCX_ON_ETH0, Host, Network

MIB = 1 << 20
UCX_OVER_TCP = {**UCX_ON_ETH0, "UCX_TCP_NODELAY": "y", "NIXL_LOG_LEVEL": "WARN"}


class EngineHosts:
    """One host per engine (``prefill-0`` on 198.18.0.2, the next on .3, ...); everything else
    (NATS, schedulers, gateway, proxies, the client) stays in the root namespace, which the
    hosts reach as 198.18.0.254. ``rate_bits``: each direction between two engine hosts is
    shaped to it (per pair, at the sender: a decode fed by two prefills gets twice the rate,
    where a real decode's one NIC would be shared); None leaves the veths as they are."""

    root_address = f"{SUBNET_PREFIX}{OPERATOR}"

    def __init__(self, prefills: int, decodes: int, rate_bits: float | None):
        self.names = [f"prefill-{i}" for i in range(prefills)] + [f"decode-{i}" for i in range(decodes)]
        self.rate_bits = rate_bits
        self.network: Network | None = None
        self.hosts: dict[str, Host] = {}

    def start(self) -> "EngineHosts":
        self.network = Network().start()
        try:
            for index, name in enumerate(self.names):
                short = name[0] + name.rsplit("-", 1)[1]  # p0, d1: interface names stay short
                self.hosts[name] = self.network.add_host(short, 2 + index)
            if self.rate_bits is not None:
                # Every pair, both ways: push and pull cross prefill-decode; a fetched prefix
                # (wire.Fetch) also prefill-prefill and decode-decode.
                for name, host in self.hosts.items():
                    for other, peer in self.hosts.items():
                        if other != name:
                            host.shape(peer, self.rate_bits)
        except BaseException:
            self.stop()
            raise
        return self

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def launcher(self, name: str) -> list[str]:
        return self.hosts[name].exec_prefix()

    def kv_bytes(self) -> dict[str, int]:
        """What each engine host sent each other outside NATS (tc's counters)."""
        sent = {}
        for name, host in self.hosts.items():
            for other, peer in self.hosts.items():
                if peer.address in host.watched:
                    sent[f"{name}->{other}"] = host.bytes_to(peer)
        return sent

    def stop(self) -> None:
        if self.network is not None:
            self.network.stop()
            self.network = None


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f} s")
        time.sleep(0.02)


def _agent(name: str, size: int):
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buffer = torch.ones(size, dtype=torch.uint8)  # touched: no page faults inside the timing
    agent.register_memory(buffer)
    return agent, buffer, agent.get_xfer_descs(buffer)


def target(folder: Path, size: int, timeout_s: float) -> None:
    agent, _buffer, descs = _agent("link-target", size)
    (folder / "target.descs").write_bytes(agent.get_serialized_descs(descs))
    (folder / "target.meta.tmp").write_bytes(agent.get_agent_metadata())
    os.replace(folder / "target.meta.tmp", folder / "target.meta")
    _wait_for(folder / "result.json", timeout_s)  # the progress thread serves the WRITEs


def initiator(folder: Path, size: int, timeout_s: float) -> dict:
    _wait_for(folder / "target.meta", timeout_s)
    agent, _buffer, local = _agent("link-initiator", size)
    remote_name = agent.add_remote_agent((folder / "target.meta").read_bytes())
    remote = agent.deserialize_descs((folder / "target.descs").read_bytes())
    seconds = []
    for _ in range(2):
        handle = agent.initialize_xfer("WRITE", local, remote, remote_name, b"")
        started = time.perf_counter()
        if agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused the WRITE")
        deadline = time.monotonic() + timeout_s
        while (state := agent.check_xfer_state(handle)) == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError("the WRITE did not finish")
        if state != "DONE":
            raise RuntimeError(f"the WRITE ended {state}")
        seconds.append(time.perf_counter() - started)
        agent.release_xfer_handle(handle)
    result = {"bytes": size, "seconds": seconds[-1], "bytes_per_s": size / seconds[-1], "first_s": seconds[0]}
    (folder / "result.tmp").write_text(json.dumps(result))
    os.replace(folder / "result.tmp", folder / "result.json")
    return result


def measure(sender: Host, receiver: Host, folder: Path, mib: int = 32, timeout_s: float = 120.0) -> dict:
    """One NIXL WRITE of ``mib`` MiB from ``sender`` to ``receiver`` over UCX TCP: what it took."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("target.meta", "target.descs", "result.json"):
        (folder / name).unlink(missing_ok=True)
    env = {**os.environ, **UCX_OVER_TCP}
    command = [sys.executable, "-m", "kvpush.tools.emulation.link", "--dir", str(folder), "--mib", str(mib),
               "--timeout", str(timeout_s)]
    receiving = subprocess.Popen([*receiver.exec_prefix(), *command, "target"], env=env)
    try:
        subprocess.run([*sender.exec_prefix(), *command, "initiator"], env=env, check=True, timeout=timeout_s + 30)
        receiving.wait(timeout=30)
    finally:
        if receiving.poll() is None:
            receiving.kill()
            receiving.wait()
    return json.loads((folder / "result.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.tools.emulation.link")
    parser.add_argument("side", choices=["target", "initiator"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    folder, size = Path(args.dir), args.mib * MIB
    if args.side == "target":
        target(folder, size, args.timeout)
    else:
        print(json.dumps(initiator(folder, size, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
