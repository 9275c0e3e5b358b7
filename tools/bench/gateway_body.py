"""What a large chunked request body costs the gateway: its RSS before, at peak and after
one body of ``--mib`` MiB sent with ``Transfer-Encoding: chunked`` (no Content-Length),
and the answer it got.

Real: ``kvpush gateway`` in a process of its own (from ``--repo``, so a checkout of an
older commit can be measured the same way) over a local nats-server with the deployed
``max_payload`` (8 MB, deploy/nats-server.conf), the gateway's body limit; no scheduler
or workers, as the body is refused before any request leaves the gateway.

    .venv/bin/python -m kvpush.tools.bench.gateway_body                      # this checkout
    git worktree add /tmp/gw-before HEAD~3
    .venv/bin/python -m kvpush.tools.bench.gateway_body --repo /tmp/gw-before

Prints one JSON object. RSS is sampled every 5 ms while the body goes out; ``hwm`` is the
kernel's high-water mark (VmHWM), which no sample can miss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from kvpush.services.launch.natsd import LocalNatsServer, free_port, terminate

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
MAX_PAYLOAD = "8MB"  # deploy/nats-server.conf's


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the gateway did not answer /health")


def measure(repo: Path, mib: int, chunk_kib: int = 64) -> dict:
    folder = tempfile.TemporaryDirectory(prefix="kvpush-gateway-body-")
    config = Path(folder.name) / "nats-server.conf"
    config.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    with folder, LocalNatsServer(config=config) as nats_server:
        port = free_port()
        env = {**os.environ, "KVPUSH_LOG_LEVEL": "WARNING", "PYTHONPATH": str(repo)}
        process = subprocess.Popen([sys.executable, "-m", "kvpush.services.cli.main", "gateway", "--nats-url",
                                    nats_server.url, "--port", str(port)], cwd=repo, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process)
            gateway = psutil.Process(process.pid)
            time.sleep(1.0)  # let start-up settle
            before, hwm_before = gateway.memory_info().rss, _hwm(process.pid)
            peak = before
            sending = True

            def sample() -> None:
                nonlocal peak
                while sending:
                    peak = max(peak, gateway.memory_info().rss)
                    time.sleep(0.005)

            sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
            sampler.start()
            chunk = b"x" * (chunk_kib * 1024)
            sent = 0

            def body():
                nonlocal sent
                yield b'{"prompt": "'
                for _ in range(mib * MIB // len(chunk)):
                    sent += len(chunk)
                    yield chunk
                yield b'"}'

            started = time.monotonic()
            try:
                reply = httpx.post(url + "/v1/completions", content=body(), timeout=120,
                                   headers={"content-type": "application/json"})
                answer = {"status": reply.status_code, "error": reply.json().get("error", {}).get("code")}
            except httpx.HTTPError as exc:  # the gateway may close the connection once it has answered
                answer = {"status": None, "error": f"{type(exc).__name__}: {exc}"}
            seconds = time.monotonic() - started
            time.sleep(0.5)
            sending = False
            sampler.join()
            after, hwm_after = gateway.memory_info().rss, _hwm(process.pid)
        finally:
            terminate(process)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    if subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True).stdout.strip():
        commit += "+changes"
    return {"repo": str(repo), "commit": commit, "max_payload": MAX_PAYLOAD, "body_mib": mib, "sent_mib": round(sent / MIB, 1),
            **answer, "seconds": round(seconds, 2),
            "rss_before_mib": round(before / MIB, 1), "rss_peak_mib": round(peak / MIB, 1),
            "rss_after_mib": round(after / MIB, 1), "rss_growth_mib": round((peak - before) / MIB, 1),
            "hwm_before_mib": round(hwm_before / MIB, 1), "hwm_after_mib": round(hwm_after / MIB, 1),
            "hwm_growth_mib": round((hwm_after - hwm_before) / MIB, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose gateway runs (default: this one)")
    parser.add_argument("--mib", type=int, default=96, help="body size in MiB")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.repo.resolve(), args.mib)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
