"""The one thread that owns the NIXL agent.

Everything NIXL goes through here: creating the agent, registering the KV pool,
adding remote agents, building descriptors, posting WRITEs (push) or READs (pull) with
a notification, polling them to completion, and polling for notifications from peers. Nothing
else touches the agent. vLLM's engine loop only enqueues work and never waits on it;
completions are driven by this thread, not by the engine's step cadence.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from kvpush.connector.block_ranges import HeadSlice, byte_ranges, coalesce
from kvpush.connector.compute_marks import COMPUTED, ComputeMark
from kvpush.connector.kv_layout import KvLayout
from kvpush.connector.tp_map import Shard
from kvpush.otel import attributes as A
from kvpush.shared import chaos
from kvpush.shared.wire import AgentInfo

log = logging.getLogger("kvpush.transfer")
_tracer = trace.get_tracer("kvpush.transfer")

# How long the thread sleeps between polls: just after a peer said its WRITE ended, while
# it only awaits peers' WRITE notifications, and when idle. None of them is on the path of
# a notification: the engine asks for a poll at every step's end while it expects one
# (``poll_notifications_now``), and the producer's TransferDone (over NATS, see ``poke``)
# makes the thread poll at once when the KV is due, for an engine that has nothing to step.
# The timed polls only catch a notification whose TransferDone was lost, so a decode
# waiting for pushed KV can poll slowly (EXPECT_POLL_S) and save ~0.1 CPU-s/s per wait.
ACTIVE_POLL_S = 0.0005
EXPECT_POLL_S = 0.02
IDLE_POLL_S = 0.05
EAGER_AFTER_POKE_S = 0.01  # how long a poke keeps the thread polling at ACTIVE_POLL_S
# While our own transfers run, the thread checks them at once, then backs off from
# FIRST_BACKOFF_S, doubling up to IN_FLIGHT_MAX_BACKOFF_S: UCX moves bytes inside those
# checks, and a small WRITE ends in ~0.1 ms, so a coarse poll would cost more than it.
FIRST_BACKOFF_S = 0.00002
IN_FLIGHT_MAX_BACKOFF_S = 0.0001
MAX_REMOTE_AGENTS = 256  # peers (engine starts) whose NIXL agents stay loaded
# A transfer still running after this long has a dead or hung peer. NIXL cannot cancel
# a posted transfer, so it is reported stuck (``TransferResult.stuck``) and still polled:
# its blocks stay held on both sides until it ends, and its end is reported again.
STUCK_AFTER_S = 30.0

os.environ.setdefault("UCX_TCP_NODELAY", "y")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@dataclass
class TransferResult:
    transfer_id: str
    ok: bool
    bytes: int = 0
    descriptors: int = 0
    prepare_ms: float = 0.0
    write_ms: float = 0.0
    error: str = ""
    stuck: bool = False  # still running after STUCK_AFTER_S; on_done is called again when it ends


@dataclass
class TransferJob:
    """Copy blocks between this agent and ``remote``: "WRITE" pushes local blocks into the
    remote's, "READ" pulls the remote's blocks into local ones. The peer is notified."""

    op: str  # "WRITE" | "READ"
    transfer_id: str
    remote: AgentInfo
    local_block_ids: list[int]
    remote_block_ids: list[int]
    notif: bytes
    on_done: Callable[[TransferResult], None]  # runs on the transfer thread, inside the job's span
    parent: Context | None = None  # the request's trace context, carried across the thread boundary
    regions: tuple[int, int] | None = None  # only regions[first:end] of the layout (a layer's); None: all
    # Tensor parallelism: the heads of each block that move, ours and the remote's (None: whole blocks)
    local_part: HeadSlice | None = None
    remote_part: HeadSlice | None = None
    # A WRITE of blocks the running step computes leaves once they are in memory
    # (compute_marks.py: at once on a synchronous device).
    computed: ComputeMark = COMPUTED


@dataclass
class _InFlight:
    job: TransferJob
    handle: object
    nbytes: int
    descriptors: int
    prepare_ms: float
    posted_at: float
    span: trace.Span
    transfer_span: trace.Span
    reported_stuck: bool = False


_STOP = object()
_POKE = object()


@dataclass(frozen=True)
class _PollNow:
    done: threading.Event  # set once the thread has read the notifications that had come


class TransferThread:
    def __init__(
        self,
        engine_id: str,
        rank: int,
        layout: KvLayout,
        on_notification: Callable[[bytes], None] | None = None,
        incarnation: str = "",
        max_remote_agents: int = MAX_REMOTE_AGENTS,
        shard: Shard | None = None,
    ):
        self.engine_id = engine_id
        self.shard = shard or Shard(0, 1, rank)  # the KV heads this rank holds, as its agent says
        self._chaos = chaos.Chaos.from_env()  # a fault test's dropped WRITEs (chaos.WRITE_POINT), if any
        self.max_remote_agents = max_remote_agents
        self.incarnation = incarnation
        self.rank = rank
        self.layout = layout
        self.agent_name = f"{engine_id}-r{rank}-{uuid.uuid4().hex[:8]}"
        self.agent_metadata: bytes = b""
        self._on_notification = on_notification
        self._jobs: queue.Queue = queue.Queue(maxsize=10_000)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._expecting = 0  # notifications decode waits for; guarded by _expect_lock
        self._expect_lock = threading.Lock()
        self.posted = 0  # transfers posted so far (written by the thread only)
        self._thread = threading.Thread(target=self._run, name=f"kvpush-transfer-{rank}", daemon=True)

    # ------------------------------------------------------------------ other threads

    def start(self, timeout: float = 60.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("NIXL agent did not start")
        if self._error is not None:
            raise self._error

    def agent_info(self) -> AgentInfo:
        return AgentInfo(
            engine_id=self.engine_id,
            rank=self.rank,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata,
            mem_type=self.layout.mem_type,
            device_id=self.layout.device_id,
            num_blocks=self.layout.num_blocks,
            regions=self.layout.regions,
            incarnation=self.incarnation,
            tp_size=self.shard.tp_size,
            head_start=self.shard.first_head if self.layout.heads else 0,
            heads=self.layout.heads,
        )

    def submit(self, job: TransferJob) -> None:
        self._jobs.put_nowait(job)

    def expect(self, count: int) -> None:
        """``count`` more (or, negative, fewer) peer notifications are awaited: poll eagerly."""
        with self._expect_lock:
            self._expecting = max(0, self._expecting + count)

    def expecting(self) -> bool:
        """Peer notifications are awaited (``expect``)."""
        with self._expect_lock:
            return self._expecting > 0

    def poke(self) -> None:
        """A peer says a WRITE into our blocks ended: poll for its notification now, and
        eagerly for a moment (the notification may trail the message). A forged poke
        costs a few polls; only the notification itself counts as arrival."""
        try:
            self._jobs.put_nowait(_POKE)
        except queue.Full:
            pass

    def poll_notifications_now(self, timeout_s: float) -> bool:
        """Have the thread read peers' notifications now, and wait (at most ``timeout_s``)
        until it has: each one that had come by then has reached ``on_notification``. The
        engine calls this at a step's end, so KV that landed during the step is counted in
        that step, whatever the timed polls' cadence. False if the thread did not answer in
        time (it was busy posting a transfer, say); the timed polls then catch it."""
        request = _PollNow(threading.Event())
        try:
            self._jobs.put_nowait(request)
        except queue.Full:
            return False
        return request.done.wait(timeout_s)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config

            agent = nixl_agent(
                self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=[])
            )
            agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
            regs = [(addr, length, self.layout.device_id, "") for addr, length in self.layout.buffers]
            agent.register_memory(regs, self.layout.mem_type)
            self.agent_metadata = agent.get_agent_metadata()
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._agent = agent
        # Peers loaded into NIXL, least recently used first; each restart of a peer is a new
        # agent, so the oldest are removed past max_remote_agents (none with a transfer posted).
        self._known_agents: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._in_flight: list[_InFlight] = []
        self._not_computed: list[TransferJob] = []  # WRITEs whose blocks the device still computes
        self._ready.set()
        eager_until = 0.0
        backoff = 0.0  # while our own transfers run: the pause between checks, doubling to ACTIVE_POLL_S
        while True:
            self._post_computed()
            if self._in_flight:
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    item = None
                    if backoff:
                        time.sleep(backoff)
                    backoff = min(IN_FLIGHT_MAX_BACKOFF_S, max(FIRST_BACKOFF_S, backoff * 2))
            else:
                backoff = 0.0
                with self._expect_lock:
                    expecting = self._expecting > 0
                if time.monotonic() < eager_until or self._not_computed:
                    timeout = ACTIVE_POLL_S
                else:
                    timeout = EXPECT_POLL_S if expecting else IDLE_POLL_S
                try:
                    item = self._jobs.get(timeout=timeout)
                except queue.Empty:
                    item = None
            if item is _STOP:
                break
            if item is _POKE:
                eager_until = time.monotonic() + EAGER_AFTER_POKE_S
            elif isinstance(item, _PollNow):
                pass  # this round's poll below is the one asked for
            elif item is not None:
                if item.computed.done():
                    self._post(item)
                else:
                    self._not_computed.append(item)
                backoff = 0.0
            if self._poll_writes():
                backoff = 0.0
            if self._on_notification is not None:
                self._poll_notifications()
            if isinstance(item, _PollNow):
                item.done.set()
        for flight in self._in_flight:
            self._finish(flight, ok=False, error="transfer thread stopped")
        for job in self._not_computed:
            job.on_done(TransferResult(job.transfer_id, ok=False, error="transfer thread stopped"))

    def _post_computed(self) -> None:
        """Post the waiting WRITEs whose blocks are computed now, in the order they came."""
        if not self._not_computed:
            return
        waiting: list[TransferJob] = []
        for job in self._not_computed:
            if job.computed.done():
                self._post(job)
            else:
                waiting.append(job)
        self._not_computed = waiting

    def _post(self, job: TransferJob) -> None:
        chaos.point(f"transfer.posting.{job.op}")  # a test holds a READ (or WRITE) before it starts here
        name = A.KV_WRITE if job.op == "WRITE" else A.KV_READ
        span = _tracer.start_span(name, context=job.parent, attributes={
            A.TRANSFER_ID: job.transfer_id, A.RANK: self.rank, A.PEER_RANK: job.remote.rank})
        try:
            try:
                self._chaos_drop(job)
                posted = self._prepare_and_post(job, span)
            except Exception as exc:
                if not _disconnected(exc):
                    raise
                # The connection to the peer failed since the last transfer (its link was
                # cut, or UCX timed it out): forget the agent and meet it anew, once.
                log.info("NIXL agent %s was disconnected; connecting again", job.remote.agent_name)
                self._forget_agent(job.remote.agent_name)
                posted = self._prepare_and_post(job, span)
        except Exception as exc:
            log.warning("%s %s could not be posted: %s", job.op, job.transfer_id, exc)
            self._forget_agent(job.remote.agent_name)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            with trace.use_span(span, end_on_exit=True):
                job.on_done(TransferResult(job.transfer_id, ok=False, error=str(exc)))
            return
        handle, local, prepare_ms, posted_at, transfer_span = posted
        nbytes = sum(n for _, n in local)
        span.set_attributes({A.BYTES: nbytes, A.DESCRIPTORS: len(local), A.BLOCKS: len(job.local_block_ids)})
        self._in_flight.append(
            _InFlight(job, handle, nbytes, len(local), prepare_ms, posted_at, span, transfer_span)
        )
        self.posted += 1
        # Posted, not yet progressed (this thread drives UCX): a test holds the write open here.
        chaos.point("transfer.posted")

    def _chaos_drop(self, job: TransferJob) -> None:
        """A fault test fails this rank's WRITEs (``kv.write.<rank>``): raise as NIXL's refusal would."""
        point = f"{chaos.WRITE_POINT}.{self.rank}"
        if job.op == "WRITE" and self._chaos is not None and self._chaos.drops(point):
            raise RuntimeError(f"chaos dropped the WRITE ({point})")

    def _prepare_and_post(self, job: TransferJob, span) -> tuple:
        started = time.perf_counter()
        with trace.use_span(span, end_on_exit=False), _tracer.start_as_current_span(A.KV_TRANSFER_PREPARE):
            remote = job.remote
            if remote.agent_name not in self._known_agents:
                self._agent.add_remote_agent(remote.agent_metadata)
                self._forget_old_agents()
            self._known_agents[remote.agent_name] = None
            self._known_agents.move_to_end(remote.agent_name)
            runs = coalesce(job.local_block_ids, job.remote_block_ids)
            first, end = job.regions if job.regions is not None else (0, len(self.layout.regions))
            local, far = byte_ranges(runs, self.layout.regions[first:end], remote.regions[first:end],
                                     job.local_part, job.remote_part)
            local_descs = self._agent.get_xfer_descs(
                _as_array(local, self.layout.device_id), self.layout.mem_type
            )
            remote_descs = self._agent.get_xfer_descs(
                _as_array(far, remote.device_id), remote.mem_type
            )
            handle = self._agent.initialize_xfer(
                job.op, local_descs, remote_descs, remote.agent_name, job.notif
            )
        prepare_ms = (time.perf_counter() - started) * 1000
        transfer_span = _tracer.start_span(A.KV_TRANSFER, context=trace.set_span_in_context(span))
        posted_at = time.perf_counter()
        try:
            state = self._agent.transfer(handle)
        except Exception:
            transfer_span.end()
            self._release(handle)
            raise
        if state == "ERR":
            transfer_span.end()
            self._release(handle)
            raise RuntimeError(f"NIXL refused to post the {job.op}")
        return handle, local, prepare_ms, posted_at, transfer_span

    def _release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            pass

    def _forget_old_agents(self) -> None:
        busy = {flight.job.remote.agent_name for flight in self._in_flight}
        for name in list(self._known_agents):
            if len(self._known_agents) < self.max_remote_agents:
                break
            if name not in busy:
                self._agent.remove_remote_agent(name)
                del self._known_agents[name]

    def _forget_agent(self, name: str) -> None:
        """Drop a peer whose connection failed, so the next transfer to it connects anew."""
        if name in self._known_agents and not any(f.job.remote.agent_name == name for f in self._in_flight):
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                log.warning("could not forget NIXL agent %s: %s", name, exc)
            del self._known_agents[name]

    def known_agents(self) -> list[str]:
        """The peers loaded into NIXL now, least recently used first."""
        return list(self._known_agents)

    def _poll_writes(self) -> bool:
        """Check every posted transfer; True if one ended."""
        still: list[_InFlight] = []
        disconnected: set[str] = set()
        for flight in self._in_flight:
            try:
                state = self._agent.check_xfer_state(flight.handle)
            except Exception as exc:
                # NIXL raises for a peer that is gone (NIXL_ERR_REMOTE_DISCONNECT: its process
                # died, or UCX timed out on a cut link). The transfer has ended, badly; this
                # thread owns every NIXL call and must outlive it.
                self._finish(flight, ok=False, error=f"{flight.job.op} failed: {type(exc).__name__}: {exc}")
                disconnected.add(flight.job.remote.agent_name)
                continue
            if state == "PROC":
                if not flight.reported_stuck and time.perf_counter() - flight.posted_at > STUCK_AFTER_S:
                    flight.reported_stuck = True
                    self._report_stuck(flight)
                still.append(flight)
            else:
                self._finish(flight, ok=state == "DONE", error="" if state == "DONE" else f"{flight.job.op} failed")
                if state != "DONE":
                    disconnected.add(flight.job.remote.agent_name)  # whatever failed, meet the peer anew
        ended = len(still) < len(self._in_flight)
        self._in_flight = still
        for name in disconnected:
            self._forget_agent(name)
        return ended

    def _report_stuck(self, flight: _InFlight) -> None:
        log.error("%s %s still running after %g s; it cannot be cancelled, so its blocks stay held",
                  flight.job.op, flight.job.transfer_id, STUCK_AFTER_S)
        with trace.use_span(flight.span, end_on_exit=False):
            flight.job.on_done(TransferResult(flight.job.transfer_id, ok=False, stuck=True,
                                              error=f"{flight.job.op} still running after {STUCK_AFTER_S:g} s"))

    def _finish(self, flight: _InFlight, ok: bool, error: str) -> None:
        flight.transfer_span.end()
        try:
            self._agent.release_xfer_handle(flight.handle)
        except Exception:
            pass
        if not ok:
            flight.span.set_status(Status(StatusCode.ERROR, error))
        with trace.use_span(flight.span, end_on_exit=True):
            flight.job.on_done(
                TransferResult(
                    flight.job.transfer_id,
                    ok=ok,
                    bytes=flight.nbytes,
                    descriptors=flight.descriptors,
                    prepare_ms=flight.prepare_ms,
                    write_ms=(time.perf_counter() - flight.posted_at) * 1000,
                    error=error,
                )
            )

    def _poll_notifications(self) -> None:
        try:
            notifications = self._agent.get_new_notifs()
        except Exception as exc:  # a peer's connection failed; the others' come on the next poll
            log.warning("NIXL could not read notifications: %s", exc)
            return
        for messages in notifications.values():
            for message in messages:
                try:
                    self._on_notification(message)
                except Exception:
                    log.exception("bad notification %r", message)


def _disconnected(exc: Exception) -> bool:
    """NIXL's error for a peer whose connection failed (``nixlRemoteDisconnectError``)."""
    return "DISCONNECT" in f"{type(exc).__name__} {exc}".upper()


def _as_array(ranges: list[tuple[int, int]], device_id: int) -> np.ndarray:
    out = np.empty((len(ranges), 3), dtype=np.uint64)
    for i, (addr, length) in enumerate(ranges):
        out[i] = (addr, length, device_id)
    return out
