"""A link like a GPU cluster's, between two hosts of the multi-host rig: the rate that
:func:`~kvpush.tools.emulation.time_model.shaped_link_rate` gives, set with tc, and a probe
that measures what one NIXL WRITE over UCX TCP gets through it.

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

from kvpush.tools.hosts.network import Host

MIB = 1 << 20
UCX_OVER_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "UCX_TCP_NODELAY": "y", "NIXL_LOG_LEVEL": "WARN"}


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
