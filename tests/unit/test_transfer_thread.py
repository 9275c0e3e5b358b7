"""Real NIXL agents in two processes: the transfer thread WRITEs blocks into a peer."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time

import msgspec
import torch

from kvpush.connector.completion import Notification, notification, parse_notification
from kvpush.connector.kv_layout import describe
from kvpush.connector.transfer_thread import TransferJob, TransferThread
from kvpush.shared.wire import AgentInfo

NUM_BLOCKS = 16
# two "layers" of [num_blocks, kv_heads=2, block_size=4, 2*head=8] fp32, in one buffer
SHAPE = (NUM_BLOCKS, 2, 4, 8)


def _kv_caches(fill: float) -> dict[str, torch.Tensor]:
    pool = torch.full((2, *SHAPE), fill, dtype=torch.float32)
    return {f"model.layers.{i}.attn": pool[i] for i in range(2)}


def _decode_side(conn) -> None:
    caches = _kv_caches(0.0)
    notes: list[bytes] = []
    thread = TransferThread("decode", 0, describe(caches, NUM_BLOCKS), on_notification=notes.append)
    thread.start()
    thread.expect(1)
    conn.send_bytes(msgspec.msgpack.encode(thread.agent_info()))
    deadline = time.monotonic() + 20
    while not notes and time.monotonic() < deadline:
        time.sleep(0.005)
    conn.send([n.decode() for n in notes])
    conn.send({name: t.clone().numpy().tolist() for name, t in caches.items()})
    thread.stop()


@contextlib.contextmanager
def _decode_peer():
    """A decode side in its own process: (its process, our end of its pipe, its agent)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, args=(child,))
    proc.start()
    try:
        yield proc, parent, msgspec.msgpack.decode(parent.recv_bytes(), type=AgentInfo)
    finally:
        proc.join(timeout=30)


def test_write_lands_in_the_registered_blocks_of_another_process():
    with _decode_peer() as (proc, parent, remote):
        caches = _kv_caches(0.0)
        for name, tensor in caches.items():
            for block in range(NUM_BLOCKS):
                tensor[block] = 1000 * int(name.split(".")[2]) + block
        writer = TransferThread("prefill", 0, describe(caches, NUM_BLOCKS))
        writer.start()
        results = []
        src, dst = [0, 1, 2, 7], [5, 6, 7, 12]
        writer.submit(
            TransferJob("WRITE", "t-1", remote, src, dst, notification("t-1", 0, 1, "tag"), results.append)
        )
        notes = parent.recv()
        landed = parent.recv()
        writer.stop()
    assert [parse_notification(n.encode()) for n in notes] == [Notification("t-1", 0, 1, "tag")]
    assert len(results) == 1 and results[0].ok, results
    # 2 layers x 2 runs ([0,1,2]->[5,6,7] and [7]->[12])
    assert results[0].descriptors == 4
    block_bytes = 2 * 4 * 8 * 4
    assert results[0].bytes == 2 * 4 * block_bytes
    for layer in range(2):
        got = torch.tensor(landed[f"model.layers.{layer}.attn"])
        for s, d in zip(src, dst):
            assert torch.all(got[d] == 1000 * layer + s)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert torch.all(got[untouched] == 0)


class HeldMark:
    """A compute mark the test says is done (compute_marks.py): the device still computes
    the blocks until then."""

    def __init__(self) -> None:
        self.computed = False

    def done(self) -> bool:
        return self.computed


def test_a_write_of_blocks_still_being_computed_leaves_once_they_are_and_others_go_meanwhile():
    """On a device that runs on after the forward returned (a GPU, the emulated one), a WRITE
    the step's hook asked for waits for its compute mark; a WRITE of computed blocks is not
    held behind it."""
    with _decode_peer() as (proc, parent, remote):
        caches = _kv_caches(3.0)
        writer = TransferThread("prefill", 0, describe(caches, NUM_BLOCKS))
        writer.start()
        results = []
        held = HeldMark()
        writer.submit(TransferJob("WRITE", "t-held", remote, [0], [5], notification("t-held", 0, 1, "tag"),
                                  results.append, computed=held))
        assert writer.poll_notifications_now(10)  # the thread has taken the job in
        assert writer.posted == 0 and results == []
        writer.submit(TransferJob("WRITE", "t-free", remote, [1], [6], b"", results.append))
        deadline = time.monotonic() + 20
        while not results and time.monotonic() < deadline:
            writer.poll_notifications_now(1)
        assert [r.transfer_id for r in results] == ["t-free"] and writer.posted == 1
        held.computed = True
        while len(results) < 2 and time.monotonic() < deadline:
            writer.poll_notifications_now(1)
        notes = parent.recv()
        landed = parent.recv()
        writer.stop()
    assert [r.transfer_id for r in results] == ["t-free", "t-held"] and all(r.ok for r in results), results
    assert [parse_notification(n.encode()).transfer_id for n in notes] == ["t-held"]
    assert torch.all(torch.tensor(landed["model.layers.0.attn"])[5] == 3.0)


def test_a_write_to_a_stopped_peer_is_reported_stuck_and_its_late_end_reported_again(monkeypatch):
    """Over UCX's TCP transport a WRITE needs the peer to progress: a peer stopped with
    SIGSTOP holds it posted. NIXL cannot cancel it, so the transfer thread reports it stuck
    (the blocks must stay held) and keeps polling; the bytes land once the peer resumes."""
    import os
    import signal

    from kvpush.connector import transfer_thread

    monkeypatch.setenv("UCX_TLS", "tcp")  # no shared memory, no CMA: the peer must take part
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setattr(transfer_thread, "STUCK_AFTER_S", 1.0)
    with _decode_peer() as (proc, parent, remote):
        try:
            caches = _kv_caches(7.0)
            writer = TransferThread("prefill", 0, describe(caches, NUM_BLOCKS))
            writer.start()
            os.kill(proc.pid, signal.SIGSTOP)
            results = []
            writer.submit(TransferJob("WRITE", "t-1", remote, [0, 1], [3, 4], notification("t-1", 0, 1, "tag"),
                                      results.append))
            deadline = time.monotonic() + 20
            while not results and time.monotonic() < deadline:
                time.sleep(0.01)
            assert [(r.ok, r.stuck) for r in results] == [(False, True)]  # stuck, not failed: it may still land
            os.kill(proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while len(results) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            notes = parent.recv()
            landed = parent.recv()
            writer.stop()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
    assert [(r.ok, r.stuck) for r in results] == [(False, True), (True, False)]
    assert notes == [notification("t-1", 0, 1, "tag").decode()]  # the peer was told, late
    for layer in range(2):
        got = torch.tensor(landed[f"model.layers.{layer}.attn"])
        assert torch.all(got[[3, 4]] == 7.0)  # the late write did land: freeing these blocks early would be unsafe


def test_a_write_to_a_peer_that_dies_fails_and_the_thread_goes_on_writing(monkeypatch):
    """The peer's process dies with the write posted (SIGSTOP holds it there, then SIGKILL):
    NIXL raises NIXL_ERR_REMOTE_DISCONNECT. The write is reported failed, not stuck (nothing
    can land from a closed connection); the transfer thread, which owns every NIXL call,
    lives on, forgets the dead peer, and writes to the next one."""
    import os
    import signal

    from kvpush.connector import transfer_thread

    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setattr(transfer_thread, "STUCK_AFTER_S", 60.0)
    ctx = mp.get_context("spawn")
    peers = []
    try:
        for _ in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_decode_side, args=(child,))
            proc.start()
            peers.append((proc, parent, msgspec.msgpack.decode(parent.recv_bytes(), type=AgentInfo)))
        (doomed, _, doomed_info), (live, live_conn, live_info) = peers
        caches = _kv_caches(7.0)
        writer = TransferThread("prefill", 0, describe(caches, NUM_BLOCKS))
        writer.start()
        os.kill(doomed.pid, signal.SIGSTOP)
        results = []
        writer.submit(TransferJob("WRITE", "t-dead", doomed_info, [0, 1], [3, 4],
                                  notification("t-dead", 0, 1, "tag"), results.append))
        time.sleep(0.5)  # posted; the stopped peer cannot take it
        assert results == []
        os.kill(doomed.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(r.ok, r.stuck) for r in results] == [(False, False)], results
        assert doomed_info.agent_name not in writer.known_agents()
        writer.submit(TransferJob("WRITE", "t-next", live_info, [0, 1], [3, 4],
                                  notification("t-next", 0, 1, "tag"), results.append))
        notes = live_conn.recv()
        landed = live_conn.recv()
        writer.stop()
    finally:
        for proc, _, _ in peers:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
            proc.join(timeout=30)
    assert [(r.ok, r.transfer_id) for r in results] == [(False, "t-dead"), (True, "t-next")]
    assert notes == [notification("t-next", 0, 1, "tag").decode()]
    assert torch.all(torch.tensor(landed["model.layers.0.attn"])[[3, 4]] == 7.0)


def _many_decode_sides(conn, count: int) -> None:
    """``count`` decode-side agents in one process, each expecting one write; the blocks
    each got, once all have their notification."""
    threads, notes, caches = [], [], []
    for n in range(count):
        caches.append(_kv_caches(0.0))
        notes.append([])
        thread = TransferThread(f"decode{n}", 0, describe(caches[n], NUM_BLOCKS), on_notification=notes[n].append)
        thread.start()
        thread.expect(1)
        threads.append(thread)
    conn.send([msgspec.msgpack.encode(t.agent_info()) for t in threads])
    deadline = time.monotonic() + 30
    while not all(notes) and time.monotonic() < deadline:
        time.sleep(0.005)
    conn.send([len(n) for n in notes])
    conn.send([c["model.layers.0.attn"][3].clone().numpy().tolist() for c in caches])
    for thread in threads:
        thread.stop()


def test_past_max_remote_agents_the_least_recently_used_peer_is_removed_and_a_new_one_still_written():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_many_decode_sides, args=(child, 3))
    proc.start()
    try:
        remotes = [msgspec.msgpack.decode(raw, type=AgentInfo) for raw in parent.recv()]
        caches = _kv_caches(5.0)
        writer = TransferThread("prefill", 0, describe(caches, NUM_BLOCKS), max_remote_agents=2)
        writer.start()
        results = []
        loaded = []
        for n, remote in enumerate(remotes):
            writer.submit(TransferJob("WRITE", f"t-{n}", remote, [1], [3], notification(f"t-{n}", 0, 1, "tag"),
                                      results.append))
            deadline = time.monotonic() + 20
            while len(results) <= n and time.monotonic() < deadline:
                time.sleep(0.005)
            loaded.append(writer.known_agents())
        got = parent.recv()
        landed = parent.recv()
        writer.stop()
    finally:
        proc.join(timeout=30)
    assert [r.ok for r in results] == [True, True, True], results
    names = [r.agent_name for r in remotes]
    assert loaded == [names[:1], names[:2], names[1:]]  # the first peer went when the third came
    assert got == [1, 1, 1]
    assert all(torch.all(torch.tensor(block) == 5.0) for block in landed)
