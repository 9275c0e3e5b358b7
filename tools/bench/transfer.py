"""``kvpush bench-transfer``: our transfer thread against a raw NIXL WRITE of the same bytes
between the same two processes.

The target process holds a KV-like pool (4 regions, like 4 layers, of equally sized
blocks) behind a TransferThread. The initiator registers the same pool twice: once in
our TransferThread (timed from submit to its on_done callback: descriptor building,
coalescing, the thread handoff, the WRITE and its completion) and once in a bare NIXL
agent (timed from posting a prepared WRITE to DONE). Blocks are either contiguous (one
range per region after coalescing) or scattered (a random set of blocks).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from kvpush.connector.block_ranges import byte_ranges, coalesce
from kvpush.shared.wire import AgentInfo

REGIONS = 4
BLOCK_LEN = 128 * 1024
NUM_BLOCKS = 1024  # per region: a 512 MiB pool per process
SIZES_MIB = (1, 4, 16, 64, 256)
REPEATS = 5


def _pool():
    import torch

    pool = torch.ones((REGIONS, NUM_BLOCKS, BLOCK_LEN // 4), dtype=torch.float32)  # touched: no page faults later
    return pool, {f"layer.{i}": pool[i] for i in range(REGIONS)}


def _target(conn) -> None:
    import msgspec

    from kvpush.connector.kv_layout import describe
    from kvpush.connector.transfer_thread import TransferThread

    _, caches = _pool()
    arrived = threading.Event()
    thread = TransferThread("bench-target", 0, describe(caches, NUM_BLOCKS), on_notification=lambda _: arrived.set())
    thread.start()
    thread.expect(1)
    conn.send_bytes(msgspec.msgpack.encode(thread.agent_info()))
    conn.recv()  # stop
    thread.stop()


def _blocks(num_blocks: int, scattered: bool, rng: random.Random) -> list[int]:
    if not scattered:
        return list(range(num_blocks))
    return rng.sample(range(NUM_BLOCKS), num_blocks)


class _Initiator:
    """This process's side: one pool registered in our TransferThread and in a bare NIXL
    agent, each writing into the target's blocks."""

    def __init__(self, remote: AgentInfo):
        from nixl._api import nixl_agent, nixl_agent_config

        # lazy, as torch: kv_layout and the transfer thread import it
        from kvpush.connector.kv_layout import describe
        from kvpush.connector.transfer_thread import TransferThread

        self.remote = remote
        self._pool, caches = _pool()  # kept while the agents have its memory registered
        self.layout = describe(caches, NUM_BLOCKS)
        self.ours = TransferThread("bench-ours", 0, self.layout)
        self.ours.start()
        self.raw = nixl_agent(f"bench-raw-{uuid.uuid4().hex[:6]}",
                              nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.raw.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self.raw.register_memory([(a, n, 0, "") for a, n in self.layout.buffers], "DRAM")
        self.raw.add_remote_agent(remote.agent_metadata)

    def ours_once(self, src: list[int], dst: list[int]) -> float:
        """Seconds from submitting a WRITE to our thread to its on_done callback."""
        from kvpush.connector.transfer_thread import TransferJob

        done = threading.Event()
        result = []
        started = time.perf_counter()
        self.ours.submit(TransferJob("WRITE", "bench", self.remote, src, dst, b"bench",
                                     lambda r: (result.append(r), done.set())))
        done.wait(60)
        elapsed = time.perf_counter() - started
        assert result and result[0].ok, result
        return elapsed

    def raw_once(self, src: list[int], dst: list[int]) -> tuple[float, int]:
        """(seconds from posting a prepared raw WRITE to DONE, its descriptors)."""
        import numpy as np

        raw, remote = self.raw, self.remote
        local, far = byte_ranges(coalesce(src, dst), self.layout.regions, remote.regions)
        local_descs = raw.get_xfer_descs(np.array([(a, n, 0) for a, n in local], dtype=np.uint64), "DRAM")
        remote_descs = raw.get_xfer_descs(np.array([(a, n, 0) for a, n in far], dtype=np.uint64), "DRAM")
        handle = raw.initialize_xfer("WRITE", local_descs, remote_descs, remote.agent_name, b"raw")
        started = time.perf_counter()
        raw.transfer(handle)
        while raw.check_xfer_state(handle) == "PROC":
            pass
        elapsed = time.perf_counter() - started
        raw.release_xfer_handle(handle)
        return elapsed, len(local)

    def stop(self) -> None:
        self.ours.stop()


def _row(initiator: _Initiator, size: int, scattered: bool, rng: random.Random) -> dict:
    """One size and layout: the median of REPEATS of ours and of raw, after a warm-up each."""
    blocks = size * 1024 * 1024 // (BLOCK_LEN * REGIONS)
    src = _blocks(blocks, scattered, rng)
    dst = _blocks(blocks, scattered, rng)
    initiator.ours_once(src, dst), initiator.raw_once(src, dst)  # warm-up
    ours_times = [initiator.ours_once(src, dst) for _ in range(REPEATS)]
    raw_runs = [initiator.raw_once(src, dst) for _ in range(REPEATS)]
    nbytes = blocks * BLOCK_LEN * REGIONS
    ours_s = statistics.median(ours_times)
    raw_s = statistics.median(t for t, _ in raw_runs)
    return {
        "layout": "scattered" if scattered else "contiguous",
        "mib": size,
        "descriptors": raw_runs[0][1],
        "ours_ms": ours_s * 1000,
        "raw_ms": raw_s * 1000,
        "ours_gib_s": nbytes / ours_s / 2**30,
        "raw_gib_s": nbytes / raw_s / 2**30,
        "ratio": raw_s / ours_s,
    }


def run(progress=print) -> list[dict]:
    import msgspec

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(child,), daemon=True)
    target.start()
    rows: list[dict] = []
    try:
        initiator = _Initiator(msgspec.msgpack.decode(parent.recv_bytes(), type=AgentInfo))
        rng = random.Random(0)
        for scattered in (False, True):
            for size in SIZES_MIB:
                row = _row(initiator, size, scattered, rng)
                rows.append(row)
                progress(
                    f"{row['layout']:>10} {size:4d} MiB  {row['descriptors']:5d} descriptors  ours "
                    f"{row['ours_gib_s']:6.2f} GiB/s ({row['ours_ms']:7.2f} ms)  raw {row['raw_gib_s']:6.2f} GiB/s "
                    f"({row['raw_ms']:7.2f} ms)  ours/raw {100 * row['ratio']:5.1f}%"
                )
        initiator.stop()
    finally:
        parent.send("stop")
        target.join(timeout=30)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| layout | size | descriptors | ours (GiB/s) | raw NIXL (GiB/s) | ours / raw |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['layout']} | {r['mib']} MiB | {r['descriptors']} | {r['ours_gib_s']:.2f} | "
                   f"{r['raw_gib_s']:.2f} | {100 * r['ratio']:.0f}% |")
    return "\n".join(out) + "\n"


def cmd(args) -> int:
    """``kvpush bench-transfer``."""
    rows = run(progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = markdown(rows)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0
