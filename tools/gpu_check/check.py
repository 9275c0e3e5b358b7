"""The transfer path's check: two processes on one device, each with its own kvpush
transfer thread (``connector/transfer_thread.py``, over ``connector/kv_layout.py``'s
regions of vLLM-shaped KV: ``layouts``), moving blocks both ways, every byte verified, and
timed against a raw NIXL WRITE of the same bytes.

    python -m kvpush.tools.gpu_check.check --device cuda --out DIR   # a GPU: KV in VRAM
    python -m kvpush.tools.gpu_check.check --device cpu --out DIR    # CI: KV in DRAM

Per layout (LBNHC, LBHNC, BLNHC): a WRITE of scattered and contiguous block ranges from
this process into the peer's blocks (as push does), and a READ of the peer's blocks into
ours (as pull does); after each, the receiving side checks its whole pool (the copied
blocks hold their source's bytes, every other block its own). Then, in the default
layout, transfers from 64 KiB to ``--max-mib``: ours (submit to done: descriptors, the
thread's handoff, the transfer) against a raw NIXL WRITE (a prepared handle, posted to
done), median of ``--repeats``; bandwidth by size, and the fixed cost of a transfer (ours
and raw: the time at the smallest size less its bytes at the largest size's rate).

UCX prints which protocol and transport it chose for each kind of operation
(``UCX_PROTO_INFO``); each process's output goes to a log under ``DIR`` and the transports
named there are reported. Writes ``DIR/gpu-check.json`` and ``DIR/gpu-check.md``; exits 1
unless every byte was right.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from kvpush.tools.machine import cpu_model

SWEEP_LAYOUT = "LBNHC"
TRANSPORTS = ("cuda_ipc", "cuda_copy", "gdr_copy", "rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "tcp",
              "sysv", "posix", "cma", "knem", "xpmem", "self")
INITIATOR_SEED, PEER_SEED = 1, 2


def _quiet_ucx_to(log_path: Path) -> None:
    """This process's stdout and stderr (UCX and NIXL print there) go to ``log_path``;
    UCX says which protocols it chose."""
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)


def _sizes(max_mib: int) -> list[int]:
    size, out = 64 * 1024, []
    while size <= max_mib * 1024 * 1024:
        out.append(size)
        size *= 4
    return out


# ------------------------------------------------------------------ the peer process


def _peer(conn, device: str, layers: int, blocks: int, log_path: str) -> None:
    """The other side: a pool per layout behind a transfer thread each; checks its pool
    when told what was written into it."""
    _quiet_ucx_to(Path(log_path))
    import msgspec

    from kvpush.connector.kv_layout import describe
    from kvpush.connector.transfer_thread import TransferThread
    from kvpush.tools.gpu_check import layouts

    pools, threads = {}, {}
    try:
        for name in layouts.LAYOUTS:
            pool = pools[name] = layouts.allocate(name, layers, blocks, device)
            layouts.fill(pool, PEER_SEED)
            threads[name] = TransferThread(f"gpu-check-peer-{name}", 0, describe(pool.views, blocks),
                                           on_notification=lambda _note: None)
            threads[name].start()
            threads[name].expect(1)  # poll eagerly: over TCP, UCX moves a WRITE's bytes only while we poll
        _sync(device)
        conn.send_bytes(msgspec.msgpack.encode({name: t.agent_info() for name, t in threads.items()}))
        while (command := conn.recv()) is not None:
            kind, name, copied = command
            _sync(device)
            if kind == "check":  # {block: (seed, source block)} written into ours
                conn.send(layouts.mismatches(pools[name], PEER_SEED, copied))
            elif kind == "refill":
                layouts.fill(pools[name], PEER_SEED)
                _sync(device)
                conn.send("ok")
    finally:
        for thread in threads.values():
            thread.stop()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ------------------------------------------------------------------ this process


class _Initiator:
    def __init__(self, device: str, layers: int, blocks: int, remotes: dict):
        from kvpush.connector.kv_layout import describe
        from kvpush.connector.transfer_thread import TransferThread
        from kvpush.tools.gpu_check import layouts

        self.device, self.layers, self.blocks = device, layers, blocks
        self.remotes = remotes
        self.pools = {name: layouts.allocate(name, layers, blocks, device) for name in layouts.LAYOUTS}
        self.threads = {}
        for name, pool in self.pools.items():
            layouts.fill(pool, INITIATOR_SEED)
            self.threads[name] = TransferThread(f"gpu-check-{name}", 0, describe(pool.views, blocks))
            self.threads[name].start()
        _sync(device)

    def transfer(self, layout: str, op: str, local: list[int], remote: list[int],
                 regions: tuple[int, int] | None = None) -> float:
        """One transfer through our transfer thread: submit to done, in seconds."""
        from kvpush.connector.transfer_thread import TransferJob

        done, result = threading.Event(), []
        started = time.perf_counter()
        self.threads[layout].submit(TransferJob(op, f"check-{uuid.uuid4().hex[:8]}", self.remotes[layout], local,
                                                remote, b"gpu-check", lambda r: (result.append(r), done.set()),
                                                regions=regions))
        if not done.wait(120):
            raise RuntimeError(f"{op} of {len(local)} blocks did not end in 120 s")
        elapsed = time.perf_counter() - started
        if not result[0].ok:
            raise RuntimeError(f"{op} failed: {result[0].error}")
        return elapsed

    def stop(self) -> None:
        for thread in self.threads.values():
            thread.stop()


def _block_sets(blocks: int) -> list[tuple[str, list[int], list[int]]]:
    """(name, our blocks, the peer's blocks): scattered singles, and contiguous ranges."""
    import random

    rng = random.Random(7)
    count = min(64, blocks // 4)
    scattered = rng.sample(range(blocks), 2 * count)
    run = min(128, blocks // 2)
    return [("scattered", scattered[:count], scattered[count:]),
            ("contiguous", list(range(0, run)), list(range(blocks - run, blocks)))]


def _verify(initiator: _Initiator, conn, progress) -> list[dict]:
    from kvpush.tools.gpu_check import layouts

    rows = []
    for name in layouts.LAYOUTS:
        for label, ours, theirs in _block_sets(initiator.blocks):
            # WRITE (push): our blocks into the peer's; the peer checks its whole pool.
            seconds = initiator.transfer(name, "WRITE", ours, theirs)
            conn.send(("check", name, {dst: (INITIATOR_SEED, src) for src, dst in zip(ours, theirs)}))
            write_wrong = conn.recv()
            conn.send(("refill", name, None))
            conn.recv()
            # READ (pull): the peer's blocks into ours; we check ours.
            read_seconds = initiator.transfer(name, "READ", ours, theirs)
            _sync(initiator.device)
            read_wrong = layouts.mismatches(initiator.pools[name], INITIATOR_SEED,
                                            {dst: (PEER_SEED, src) for dst, src in zip(ours, theirs)})
            layouts.fill(initiator.pools[name], INITIATOR_SEED)
            _sync(initiator.device)
            nbytes = len(ours) * initiator.layers * layouts.BLOCK_BYTES
            rows.append({"layout": name, "blocks": label, "block_count": len(ours), "bytes": nbytes,
                         "write_ms": seconds * 1000, "write_wrong_words": write_wrong,
                         "read_ms": read_seconds * 1000, "read_wrong_words": read_wrong,
                         "pool_words_checked": initiator.layers * initiator.blocks * layouts.WORDS_PER_BLOCK})
            progress(f"{name:6} {label:10} {len(ours):4d} blocks x {initiator.layers} layers: WRITE "
                     f"{'ok' if write_wrong == 0 else f'{write_wrong} WRONG words'} ({seconds * 1000:.2f} ms), READ "
                     f"{'ok' if read_wrong == 0 else f'{read_wrong} WRONG words'} ({read_seconds * 1000:.2f} ms)")
    return rows


def _sweep(initiator: _Initiator, max_mib: int, repeats: int, progress) -> list[dict]:
    """Ours against a raw NIXL WRITE of the same bytes, by size, in the default layout."""
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    from kvpush.connector.block_ranges import byte_ranges, coalesce
    from kvpush.tools.gpu_check import layouts

    layout = initiator.threads[SWEEP_LAYOUT].layout
    remote = initiator.remotes[SWEEP_LAYOUT]
    raw = nixl_agent(f"gpu-check-raw-{uuid.uuid4().hex[:6]}", nixl_agent_config(enable_prog_thread=False, backends=[]))
    raw.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    raw.register_memory([(a, n, layout.device_id, "") for a, n in layout.buffers], layout.mem_type)
    raw.add_remote_agent(remote.agent_metadata)

    def raw_once(src: list[int], dst: list[int], layers: int) -> float:
        local, far = byte_ranges(coalesce(src, dst), layout.regions[:layers], remote.regions[:layers])
        local_descs = raw.get_xfer_descs(np.array([(a, n, layout.device_id) for a, n in local], dtype=np.uint64),
                                         layout.mem_type)
        remote_descs = raw.get_xfer_descs(np.array([(a, n, remote.device_id) for a, n in far], dtype=np.uint64),
                                          remote.mem_type)
        handle = raw.initialize_xfer("WRITE", local_descs, remote_descs, remote.agent_name, b"raw")
        started = time.perf_counter()
        if raw.transfer(handle) == "ERR":
            raise RuntimeError("raw NIXL WRITE failed to post")
        while (state := raw.check_xfer_state(handle)) == "PROC":
            pass
        elapsed = time.perf_counter() - started
        raw.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL WRITE ended {state}")
        return elapsed

    rows = []
    for size in _sizes(max_mib):
        units = size // layouts.BLOCK_BYTES
        layers = 1
        while units // layers > initiator.blocks // 2 and layers * 4 <= initiator.layers:
            layers *= 4
        count = units // layers
        if count > initiator.blocks // 2 or count < 1:
            progress(f"{size >> 10} KiB: does not fit {initiator.blocks} blocks x {initiator.layers} layers; skipped")
            continue
        src, dst = list(range(count)), list(range(initiator.blocks - count, initiator.blocks))
        initiator.transfer(SWEEP_LAYOUT, "WRITE", src, dst, (0, layers)), raw_once(src, dst, layers)  # warm-up
        ours = statistics.median(initiator.transfer(SWEEP_LAYOUT, "WRITE", src, dst, (0, layers))
                                 for _ in range(repeats))
        theirs = statistics.median(raw_once(src, dst, layers) for _ in range(repeats))
        nbytes = count * layers * layouts.BLOCK_BYTES
        row = {"bytes": nbytes, "layers": layers, "blocks": count, "ours_ms": ours * 1000, "raw_ms": theirs * 1000,
               "ours_gib_s": nbytes / ours / 2**30, "raw_gib_s": nbytes / theirs / 2**30, "ours_over_raw": theirs / ours}
        rows.append(row)
        progress(f"{_size(nbytes):>8}: ours {row['ours_gib_s']:7.2f} GiB/s ({row['ours_ms']:8.3f} ms), raw "
                 f"{row['raw_gib_s']:7.2f} GiB/s ({row['raw_ms']:8.3f} ms): ours at {100 * row['ours_over_raw']:.0f}%")
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _fixed_costs(rows: list[dict]) -> dict:
    """Each side's time at the smallest size less those bytes at its largest size's rate."""
    if len(rows) < 2:
        return {}
    small, large = rows[0], rows[-1]
    out = {}
    for side in ("ours", "raw"):
        rate = large["bytes"] / (large[f"{side}_ms"] / 1000)
        out[f"{side}_ms"] = max(small[f"{side}_ms"] - small["bytes"] / rate * 1000, 0.0)
    return out


def _transports(*logs: Path) -> dict[str, int]:
    """The transports UCX named in its protocol choices, with how often."""
    seen: dict[str, int] = {}
    pattern = re.compile(r"\b(" + "|".join(TRANSPORTS) + r")\b")
    for log in logs:
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            for name in pattern.findall(line):
                seen[name] = seen.get(name, 0) + 1
    return dict(sorted(seen.items(), key=lambda item: -item[1]))


def _environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cpu": cpu_model()}
    try:
        from importlib.metadata import version

        env["nixl"] = {name: version(name) for name in ("nixl", "nixl-cu12", "nixl-cu13") if _has(name)}
    except Exception:
        pass
    if device.startswith("cuda"):
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    return env


def _has(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def run(device: str, out: Path, layers: int, blocks: int, max_mib: int, repeats: int, progress=print) -> dict:
    import msgspec

    from kvpush.shared.wire import AgentInfo

    out.mkdir(parents=True, exist_ok=True)
    peer_log, own_log = out / "ucx-peer.log", out / "ucx-initiator.log"
    for log in (peer_log, own_log):
        log.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child, device, layers, blocks, str(peer_log)), daemon=True)
    peer.start()
    report: dict = {"environment": _environment(device), "layers": layers, "blocks": blocks}
    initiator = None
    saved = os.dup(1), os.dup(2)
    try:
        if not parent.poll(300):
            raise RuntimeError("the peer process did not start in 300 s")
        remotes = msgspec.msgpack.decode(parent.recv_bytes(), type=dict[str, AgentInfo])
        _quiet_ucx_to(own_log)  # UCX's lines from here on; ours go to the saved stdout
        say = _saying(saved[0], progress)
        initiator = _Initiator(device, layers, blocks, remotes)
        report["mem_type"] = initiator.threads[SWEEP_LAYOUT].layout.mem_type
        say(f"{device}: {layers} layers x {blocks} blocks of {layouts_block_kib()} KiB a layer, KV in "
            f"{report['mem_type']}, each process {_size(layers * blocks * 65536)} per layout")
        report["verified"] = _verify(initiator, parent, say)
        report["sweep"] = _sweep(initiator, max_mib, repeats, say)
        report["fixed_cost_ms"] = _fixed_costs(report["sweep"])
    finally:
        if initiator is not None:
            initiator.stop()
        parent.send(None)
        peer.join(timeout=60)
        if peer.is_alive():
            peer.kill()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    report["transports"] = _transports(peer_log, own_log)
    report["every_byte_right"] = all(r["write_wrong_words"] == 0 and r["read_wrong_words"] == 0
                                     for r in report["verified"])
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu-check.md").write_text(markdown(report))
    return report


def layouts_block_kib() -> int:
    from kvpush.tools.gpu_check import layouts

    return layouts.BLOCK_BYTES >> 10


def _saying(fd: int, progress):
    """``progress`` to the stdout saved before UCX's output was sent to its log."""
    stream = os.fdopen(os.dup(fd), "w", buffering=1)
    return lambda line: (print(line, file=stream, flush=True), progress is not print and progress(line))


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"{env.get('gpu') or env.get('cpu')} ({env['device']}; KV in {report.get('mem_type', '?')}), "
             f"python {env['python']}, torch {env['torch']}, nixl {env.get('nixl', {})}; "
             f"{report['layers']} layers x {report['blocks']} blocks, Qwen3-32B's per-layer shape (8 KV heads of "
             f"128, bf16, 16 tokens a block: 64 KiB a block a layer)", "",
             "| layout | blocks | WRITE: wrong words | READ: wrong words | bytes each way |", "|---|---|---:|---:|---:|"]
    for r in report.get("verified", []):
        lines.append(f"| {r['layout']} | {r['block_count']} {r['blocks']} | {r['write_wrong_words']} | "
                     f"{r['read_wrong_words']} | {_size(r['bytes'])} |")
    lines += ["", f"Every byte right: **{report.get('every_byte_right')}** (each side's whole pool checked after "
                  "each transfer)", "",
              "| size | ours GiB/s | raw NIXL GiB/s | ours ms | raw ms | ours / raw |", "|---:|---:|---:|---:|---:|---:|"]
    for r in report.get("sweep", []):
        lines.append(f"| {_size(r['bytes'])} | {r['ours_gib_s']:.2f} | {r['raw_gib_s']:.2f} | {r['ours_ms']:.3f} | "
                     f"{r['raw_ms']:.3f} | {100 * r['ours_over_raw']:.0f}% |")
    fixed = report.get("fixed_cost_ms", {})
    if fixed:
        lines += ["", f"Fixed cost per transfer: ours {fixed['ours_ms']:.3f} ms, raw {fixed['raw_ms']:.3f} ms."]
    lines += ["", "Transports UCX named in its protocol choices (UCX_PROTO_INFO), with counts: "
                  + (", ".join(f"{k} {v}" for k, v in report.get("transports", {}).items()) or "none named")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (KV in VRAM) or cpu (KV in DRAM)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, help="default: 64 (Qwen3-32B's) on cuda, 4 on cpu")
    parser.add_argument("--blocks", type=int, help="per layer; default 2000 on cuda, 200 on cpu")
    parser.add_argument("--max-mib", type=int, help="the sweep's largest transfer; default 1024 on cuda, 16 on cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    report = run(args.device, Path(args.out), args.layers or (64 if cuda else 4), args.blocks or (2000 if cuda else 200),
                 args.max_mib or (1024 if cuda else 16), args.repeats)
    print(markdown(report))
    return 0 if report["every_byte_right"] else 1


if __name__ == "__main__":
    sys.exit(main())
