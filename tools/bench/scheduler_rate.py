"""``kvpush bench-scheduler``: how many requests per second ONE scheduler dispatches,
against idle workers.

Real: the scheduler (``kvpush scheduler``, in a process of its own, configured as it
ships: INFO logs, spans to local files; ``--scheduler-quiet`` turns both down), nats-server
with JetStream (``kvpush.services.launch.natsd.LocalNatsServer``, loopback), and the client
(``kvpush.client.generate`` on ``kvpush.generate``, one request per call, as
``kvpush generate`` sends it).

Not real: the workers. ``IdlePrefill`` and ``IdleDecode`` are this bench's load
generator. They have no engine; they speak the wire protocol (``kvpush.shared.wire``) the way
``services/worker/`` and ``connector/`` do in push mode with the default settings: the
same messages, types, subjects and order, each worker with its service connection
(``kvpush.services.bus.Bus``) and its connector's own connection. A prefill is done the moment
its job arrives, a decode answers ``--output-tokens`` tokens (1 by default) the moment
its KV "arrived". NIXL moves nothing: the prefill's ``TransferDone`` stands for both the
WRITE and its notification.

One request, in push mode, as the stand-ins and the real workers send it:

    client     kvpush.generate (JSON, reply: an _INBOX.* inbox)
    scheduler  JetStream: flight created ($KV.kvpush_flights.<id>), an old final purged
               ($KV.kvpush_finals.<id>), the flight rewritten with its attempt
    scheduler  PrefillJob on kvpush.prefill.<p> and DecodeJob on kvpush.decode.<d>, at
               once, each a request answered by a JobAck
    decode     Registration on kvpush.kv.register.<p>.<d> (vLLM allocated its blocks)
    prefill    TransferDone on kvpush.kv.completion.<d>.<p> once registration and the
               finished prompt met (and the WRITE ended); Handoff on kvpush.handoff.<p>
    decode     claims the answer (kvpush.claims.<hash>.decode.<id>), RequestProgress "streaming"
               on kvpush.request.progress.<d>, TokenChunk(s) to the client's inbox (each
               with a probe reply subject), the FinalReply, RequestProgress "ended" with it
    scheduler  JetStream: final kept ($KV.kvpush_finals.<id>), flight deleted

Periodic, not per request: WorkerHeartbeat every ``HEARTBEAT_INTERVAL_S`` per worker, a
LeaseRenewal per (decode, prefill) pair while transfers wait, SchedulerHeartbeat. Once
per worker start: its AgentInfo announced on kvpush.kv.agents.<id>, answered on
kvpush.kv.agent.<id>.0; a prefill asks a decode's only if it missed the announcement.

``--count-subjects`` adds a subscriber on ``>`` that counts every message and its bytes
by subject while the measured requests run (it costs the bench's own CPU: use it in a run
of its own, not for the rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.otel.messaging import TEMPORARY
from kvpush.services.bus import Bus
from kvpush.client import generate
from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.services.ledger import Claims
from kvpush.shared import settings, wire
from kvpush.shared.errors import BadJob, KvTransferFailed, to_error_body
from kvpush.shared.nats_security import connect_options
from kvpush.tools.bench import stats
from kvpush.tools.bench.cli import BLOCK_SIZE, scheduler_rate_arguments

KV_CACHE_BYTES = 2 * 1024 ** 3  # the KV cache a stand-in says it has (the stack's engines: 1-2 GiB)
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # small model: layers x (K, V) x kv heads x head_dim x fp32
AGENT_METADATA_BYTES = 514  # a real NIXL agent's metadata for the small model's cache (measured)
AGENT_REGIONS = 4  # that cache's regions: 2 layers x (K, V)
KV_WAIT_S = 30.0  # a stand-in decode gives its KV up after this (the real one waits 120 s)
MAX_HALVES = 20_000  # unmatched registrations / prompts a stand-in prefill keeps


def expected_tokens(prompt: list[int], count: int, vocab: int) -> list[int]:
    """The tokens a stand-in decode answers for ``prompt``: fixed by the prompt, so the
    client can check that each answer is its own request's."""
    base = sum(prompt) * 31 + len(prompt)
    return [(base + 7919 * i) % vocab for i in range(count)]


def _traceparent(msg) -> str:
    return (msg.headers or {}).get("traceparent", "") if msg is not None else ""


class _IdleWorker:
    """What both stand-ins share: the service connection (``Bus``), the connector's
    connection, heartbeats, the agent announcement and the job subscription."""

    role = ""
    job_type: object = None  # the union its job subject carries (its jobs and CancelJob): set by each role

    def __init__(self, url: str, worker_id: str, vocab: int, block_size: int = BLOCK_SIZE):
        self.url = url
        self.worker_id = worker_id
        self.vocab = vocab
        self.block_size = block_size
        self.total_blocks = KV_CACHE_BYTES // (block_size * KV_BYTES_PER_TOKEN)
        self.incarnation = uuid.uuid4().hex
        self.jobs = 0  # jobs accepted (acked), cancels not counted
        self.cancels = 0
        self.active = 0
        self.bus = None
        self.kv = None  # the connector's connection (the real one lives in the engine core)
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        import nats

        self.bus = await Bus.connect(self.url, self.worker_id)
        self.kv = await nats.connect(self.url, name=f"{self.worker_id}-connector",
                                     **connect_options(service=self.worker_id))
        info = wire.encode(self.agent_info())

        async def on_agent_request(msg) -> None:
            if msg.reply and wire.is_inbox(msg.reply):
                await self.kv.publish(msg.reply, info, headers={})

        await self.kv.subscribe(wire.agent_subject(self.worker_id, 0), cb=on_agent_request)
        await self.kv.subscribe(wire.KV_AGENTS.wildcard, cb=self._on_agent_announced)
        await self._subscribe_connector()
        await self.kv.publish(wire.KV_AGENTS(sender=self.worker_id), info, headers={})
        subject = (wire.PREFILL_JOBS if self.role == "prefill" else wire.DECODE_JOBS)(worker_id=self.worker_id)
        await self.bus.subscribe(subject, self._on_job)
        await self.bus.nc.flush()
        await self.kv.flush()
        self._spawn(self._heartbeat_loop())

    async def close(self) -> None:
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in (self.kv, self.bus.nc if self.bus else None):
            if conn is not None and not conn.is_closed:
                await conn.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def agent_info(self):
        return wire.AgentInfo(
            engine_id=self.worker_id, rank=0, agent_name=f"{self.worker_id}-0-{self.incarnation[:8]}",
            agent_metadata=bytes(AGENT_METADATA_BYTES), mem_type="DRAM", device_id=0, num_blocks=self.total_blocks,
            regions=[wire.KvRegion(0x7F0000000000 + r * (1 << 32), self.region_block_bytes, self.region_block_bytes)
                     for r in range(AGENT_REGIONS)],
            incarnation=self.incarnation)

    @property
    def region_block_bytes(self) -> int:
        return self.block_size * KV_BYTES_PER_TOKEN // AGENT_REGIONS

    async def _on_agent_announced(self, msg) -> None:
        return None

    async def _subscribe_connector(self) -> None:
        raise NotImplementedError

    def heartbeat_fields(self) -> dict:
        return {"queued_prompt_tokens": 0, "prefill_tokens_per_s": 0.0}

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            used = min(self.active * 8, self.total_blocks)
            beat = wire.WorkerHeartbeat(
                worker_id=self.worker_id, role=self.role, free_kv_blocks=self.total_blocks - used,
                total_kv_blocks=self.total_blocks, running=self.active, waiting=0, block_size=self.block_size,
                max_model_len=settings.MAX_MODEL_LEN, connector="kvpush", kv_params={},
                incarnation=self.incarnation, **self.heartbeat_fields())
            try:
                await self.bus.nc.publish(wire.HEARTBEATS(sender=self.worker_id), wire.encode(beat))
            except Exception:
                pass
            try:
                await asyncio.wait_for(self._stop.wait(), settings.HEARTBEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass

    async def _ack(self, msg) -> None:
        if msg.reply and wire.is_inbox(msg.reply):
            await self.bus.publish(msg.reply, wire.encode(wire.JobAck(accepted=True)), template=TEMPORARY)

    async def _on_job(self, msg) -> None:
        """A job or a CancelJob, on this worker's job subject: as the workers' job intake does,
        a job is acked and then taken (``_take``), a cancel is counted and done (``_cancel``)."""
        job = await self.bus.decoded(msg, self.job_type, refuse_as=BadJob, nack=True)
        if job is None:
            return
        if isinstance(job, wire.CancelJob):
            self.cancels += 1
            self._cancel(job)
            return
        await self._ack(msg)
        await self._take(job, _traceparent(msg))

    def _cancel(self, cancel: wire.CancelJob) -> None:
        raise NotImplementedError

    async def _take(self, job, traceparent: str) -> None:
        raise NotImplementedError

    async def _connector_publish(self, subject: str, data: bytes, traceparent: str = "") -> None:
        """As the connector's bridge publishes: with the request's trace context."""
        await self.kv.publish(subject, data, headers={"traceparent": traceparent} if traceparent else {})


class IdlePrefill(_IdleWorker):
    """A prefill worker whose engine computes every prompt at once (load generator).

    Push, as ``connector/producer.py`` and ``services/worker/prefill.py``: the finished
    prompt and decode's registration meet whichever comes first; on the match the KV is
    "written" and a ``TransferDone`` goes to the decode (and the schedulers); the worker
    announces its ``Handoff``. A registration must carry the transfer's key and come from
    the decode the scheduler chose."""

    role = "prefill"
    job_type = wire.PrefillMessage

    def __init__(self, url: str, worker_id: str, vocab: int, block_size: int = BLOCK_SIZE):
        super().__init__(url, worker_id, vocab, block_size)
        # transfer id -> (job, traceparent): prompts computed, their registration not come yet
        self._prompts: OrderedDict[str, tuple] = OrderedDict()
        self._registrations: OrderedDict[str, object] = OrderedDict()  # transfer id -> Registration, awaiting prompt
        self._agents: set[str] = set()  # decode engines whose agent we know
        self.renewals = 0
        self.agent_requests = 0
        self.transfers = 0
        self.refused = 0

    async def _on_agent_announced(self, msg) -> None:
        try:
            info = wire.decode(msg.data, wire.AgentInfo)
        except Exception:
            return
        if wire.forged_sender(msg.subject, info) is None:
            self._agents.add(info.engine_id)

    async def _subscribe_connector(self) -> None:
        await self.kv.subscribe(wire.KV_CONTROL.partly(engine_id=self.worker_id), cb=self._on_kv_control)

    def _cancel(self, cancel: wire.CancelJob) -> None:
        self._prompts.pop(cancel.transfer_id, None)
        self._registrations.pop(cancel.transfer_id, None)

    async def _take(self, job, traceparent: str) -> None:
        self.jobs += 1
        if job.mode == "push":  # the prompt is computed: offered to the rendezvous
            registration = self._registrations.pop(job.transfer_id, None)
            if registration is not None:
                await self._write(job, registration, traceparent, "registration_first")
            else:
                self._prompts[job.transfer_id] = (job, traceparent)
                while len(self._prompts) > MAX_HALVES:
                    self._prompts.popitem(last=False)
        now = time.time()
        handoff = wire.Handoff(request_id=job.request_id, transfer_id=job.transfer_id,
                               prefill_engine_id=self.worker_id,
                               first_token_id=expected_tokens(job.prompt_token_ids, 1, self.vocab)[0],
                               prefill_started_at=now, prefill_finished_at=now, error=None, kv_transfer_params=None)
        await self.bus.publish(wire.HANDOFFS(sender=self.worker_id), wire.encode(handoff))

    async def _on_kv_control(self, msg) -> None:
        try:
            message = wire.decode(msg.data, wire.KvControl)
        except Exception:
            self.refused += 1
            return
        if wire.forged_sender(msg.subject, message) is not None:
            self.refused += 1
            return
        if isinstance(message, wire.LeaseRenewal):
            self.renewals += 1
            return
        if isinstance(message, wire.Revoke):
            self._prompts.pop(message.transfer_id, None)
            self._registrations.pop(message.transfer_id, None)
            await self._connector_publish(wire.completion_subject(message.decode_engine_id, self.worker_id),
                                          wire.encode(wire.TransferFailed(
                                              transfer_id=message.transfer_id, prefill_engine_id=self.worker_id,
                                              decode_engine_id=message.decode_engine_id, rank=0, code="revoked",
                                              reason="decode gave the transfer up; nothing was written")))
            return
        waiting = self._prompts.pop(message.transfer_id, None)
        if waiting is None:
            self._registrations[message.transfer_id] = message
            while len(self._registrations) > MAX_HALVES:
                self._registrations.popitem(last=False)
            return
        await self._write(waiting[0], message, waiting[1], "prefill_first")

    async def _write(self, job, registration, traceparent: str, order: str) -> None:
        """The rendezvous matched: "WRITE" the KV and report its end."""
        if (registration.decode_engine_id != job.decode_engine_id or registration.transfer_key != job.transfer_key
                or registration.num_tokens != len(job.prompt_token_ids)):
            self.refused += 1
            return
        decode_id = registration.decode_engine_id
        if decode_id not in self._agents:  # first contact: ask for its agent (kvpush.connector.agents)
            self.agent_requests += 1
            try:
                await self.kv.request(wire.agent_subject(decode_id, 0), b"", timeout=5.0)
                self._agents.add(decode_id)
            except Exception:
                pass
        self.transfers += 1
        written = len(registration.block_ids) * self.block_size * KV_BYTES_PER_TOKEN
        done = wire.TransferDone(
            transfer_id=job.transfer_id, prefill_engine_id=self.worker_id, decode_engine_id=decode_id, rank=0,
            order=order,
            waited_ms=0.0, bytes=written, descriptors=AGENT_REGIONS, write_ms=0.0, finished_at=time.time())
        await self._connector_publish(wire.completion_subject(decode_id, self.worker_id), wire.encode(done),
                                      traceparent)


class _Fenced(Exception):
    pass


class IdleDecode(_IdleWorker):
    """A decode worker whose engine generates at once (load generator).

    Push, as ``services/worker/decode.py`` and ``connector/``: ack, register the prompt's
    blocks with the prefill, renew the prefill's lease every heartbeat while waiting, and
    once the KV "arrived" (the prefill's ``TransferDone``): claim the answer, say
    "streaming", send the chunks (one token each, each with the probe reply subject) and
    the final, and say "ended" with the final. A claim lost to a scheduler sends nothing."""

    role = "decode"
    job_type = wire.DecodeMessage

    def __init__(self, url: str, worker_id: str, vocab: int, output_tokens: int = 1,
                 block_size: int = BLOCK_SIZE):
        super().__init__(url, worker_id, vocab, block_size)
        self.output_tokens = output_tokens
        self.ledger = None
        self._waiting: dict[str, tuple[str, asyncio.Future]] = {}  # transfer id -> (prefill id, KV arrived)
        self._running: dict[str, asyncio.Task] = {}
        self._cancelled: OrderedDict[str, object] = OrderedDict()  # transfer id -> its CancelJob
        self._probes: dict[str, str] = {}
        self._probe_prefix = ""
        self._next_block = 0
        self.finals = 0
        self.fenced = 0
        self.kv_timeouts = 0

    async def start(self) -> None:
        await super().start()
        self.ledger = Claims(self.bus.nc, wire.Claimant.decode(self.worker_id))
        self._probe_prefix = self.bus.nc.new_inbox()
        await self.bus.subscribe_plain(f"{self._probe_prefix}.*", self._on_probe)
        self._spawn(self._renewal_loop())

    async def _subscribe_connector(self) -> None:
        await self.kv.subscribe(wire.KV_COMPLETIONS.partly(engine_id=self.worker_id), cb=self._on_completion)

    async def _on_probe(self, msg) -> None:
        if msg.headers and msg.headers.get("Status") == "503":
            transfer_id = self._probes.get(msg.subject.rsplit(".", 1)[-1])
            task = self._running.get(transfer_id or "")
            if task is not None:
                task.cancel()

    async def _on_completion(self, msg) -> None:
        try:
            event = wire.decode(msg.data, wire.Completion)
        except Exception:
            return
        if wire.forged_sender(msg.subject, event) is not None:
            return
        waiting = self._waiting.get(event.transfer_id)
        if waiting is None or waiting[0] != event.prefill_engine_id or waiting[1].done():
            return
        if isinstance(event, wire.TransferDone):
            waiting[1].set_result(True)
        elif isinstance(event, wire.TransferFailed):
            waiting[1].set_result(False)

    async def _renewal_loop(self) -> None:
        """connector/scheduler_side.py: one LeaseRenewal per prefill engine every heartbeat."""
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), settings.HEARTBEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            by_prefill: dict[str, list[str]] = defaultdict(list)
            for transfer_id, (prefill_id, arrived) in list(self._waiting.items()):
                if not arrived.done():
                    by_prefill[prefill_id].append(transfer_id)
            for prefill_id, transfer_ids in by_prefill.items():
                for start in range(0, len(transfer_ids), 2000):
                    renewal = wire.LeaseRenewal(decode_engine_id=self.worker_id,
                                                transfer_ids=transfer_ids[start:start + 2000])
                    await self.kv.publish(wire.registration_subject(prefill_id, self.worker_id), wire.encode(renewal))

    def _cancel(self, cancel: wire.CancelJob) -> None:
        self._cancelled[cancel.transfer_id] = cancel
        while len(self._cancelled) > 10_000:
            self._cancelled.popitem(last=False)
        task = self._running.get(cancel.transfer_id)
        if task is not None:
            task.cancel()

    async def _take(self, job, traceparent: str) -> None:
        if job.transfer_id in self._cancelled:
            return
        self.jobs += 1
        self._running[job.transfer_id] = self._spawn(self._serve(job, traceparent))

    async def _serve(self, job, traceparent: str) -> None:
        self.active += 1
        claimed = False
        outcome, final = "error", b""
        probe_key = uuid.uuid4().hex
        self._probes[probe_key] = job.transfer_id
        try:
            if job.mode == "push":
                arrived = asyncio.get_running_loop().create_future()
                self._waiting[job.transfer_id] = (job.prefill_engine_id, arrived)
                blocks = -(-len(job.prompt_token_ids) // self.block_size)
                block_ids = [(self._next_block + b) % self.total_blocks for b in range(blocks)]
                self._next_block = (self._next_block + blocks) % self.total_blocks
                registration = wire.Registration(
                    transfer_id=job.transfer_id, request_id=job.request_id, decode_engine_id=self.worker_id,
                    decode_request_id=f"{job.request_id}-d-{job.transfer_id[:8]}", decode_tp_size=1,
                    block_ids=block_ids, num_tokens=len(job.prompt_token_ids), registered_at=time.time(),
                    transfer_key=job.transfer_key, decode_incarnation=self.incarnation, first_block=0)
                await self._connector_publish(wire.registration_subject(job.prefill_engine_id, self.worker_id),
                                              wire.encode(registration), traceparent)
                try:
                    ok = await asyncio.wait_for(arrived, KV_WAIT_S)
                except asyncio.TimeoutError:
                    self.kv_timeouts += 1
                    ok = False
                if not ok:
                    raise KvTransferFailed("the prompt's KV cache did not arrive from prefill")
            tokens = expected_tokens(job.prompt_token_ids, min(self.output_tokens, job.sampling.max_tokens),
                                     self.vocab)
            claimed = (await self.ledger.claim(job.transfer_key)).won
            if not claimed:
                raise _Fenced()
            await self._progress(job, "streaming")
            for seq, token in enumerate(tokens):
                chunk = wire.TokenChunk(job.request_id, [token], f" t{token}", seq=seq)
                await self.bus.nc.publish(job.reply_to, wire.encode_json(chunk),
                                          reply=f"{self._probe_prefix}.{probe_key}")
            now = time.time()
            final = wire.encode_json(wire.FinalReply(
                request_id=job.request_id, finish_reason="length",
                usage=wire.Usage(len(job.prompt_token_ids), len(tokens)),
                timings=wire.Timings(ttft_ms=(now - job.received_at) * 1000, tpot_ms=0.0,
                                     e2e_ms=(now - job.received_at) * 1000),
                chunks=len(tokens)))
            await self.bus.publish(job.reply_to, final, template=TEMPORARY)
            self.finals += 1
            outcome = "ok"
        except asyncio.CancelledError:
            outcome = "cancelled"
            cancel = self._cancelled.get(job.transfer_id)
            if claimed and cancel is not None and getattr(cancel, "error", None) is not None:
                final = wire.encode_json(wire.ErrorReply(job.request_id, cancel.error))
                await self.bus.publish(job.reply_to, final, template=TEMPORARY)
        except _Fenced:
            self.fenced += 1
            outcome = "fenced"
        except KvTransferFailed as exc:
            if (await self.ledger.claim(job.transfer_key)).won:
                final = wire.encode_json(wire.ErrorReply(job.request_id, to_error_body(exc)))
                await self.bus.publish(job.reply_to, final, template=TEMPORARY)
        finally:
            self.active -= 1
            self._probes.pop(probe_key, None)
            self._waiting.pop(job.transfer_id, None)
            self._running.pop(job.transfer_id, None)
            await self._progress(job, "ended", outcome, final)

    async def _progress(self, job, stage: str, outcome: str = "", final: bytes = b"") -> None:
        event = wire.RequestProgress(request_id=job.request_id, transfer_id=job.transfer_id,
                                     worker_id=self.worker_id, stage=stage, outcome=outcome, final=final)
        try:
            await self.bus.publish(wire.PROGRESS(sender=self.worker_id), wire.encode(event))
        except Exception:
            pass


# --------------------------------------------------------------------------- counting


def _header_bytes(headers) -> int:
    """A message's header block, rebuilt from the parsed headers (nats-py keeps no raw copy)."""
    if headers is None:
        return 0
    return len("NATS/1.0\r\n") + sum(len(k) + len(v) + 4 for k, v in headers.items()) + 2


class SubjectCounter:
    """Every message on the server (a subscriber on ``>``), counted and sized by what it is."""

    PERIODIC = ("WorkerHeartbeat", "SchedulerHeartbeat", "LeaseRenewal", "JetStream consumer heartbeat")

    def __init__(self):
        self.active = False
        # kind -> [messages, payload bytes, header bytes, subject + reply bytes]
        self.counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._replies: OrderedDict[str, str] = OrderedDict()  # reply subject -> what it answers
        self._sub = None

    async def start(self, nc) -> None:
        self._sub = await nc.subscribe(">", cb=self._on_message, pending_msgs_limit=2_000_000,
                                       pending_bytes_limit=2 * 1024 ** 3)

    def _kind(self, msg) -> str:
        import msgspec

        subject, headers = msg.subject, msg.headers or {}
        answered = self._replies.pop(subject, None)
        if answered is not None:
            return f"reply: {answered}"
        if headers.get("Status") == "100":
            return "JetStream consumer heartbeat"
        if msg.reply.startswith("$JS.ACK."):
            stream = msg.reply.split(".")[2]
            return f"JetStream delivery: {stream} watch -> scheduler"
        if subject.startswith("_INBOX."):
            try:
                reply = wire.decode_reply(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                return "client inbox: other"
            return f"{type(reply).__name__} -> client"
        if subject.startswith("$KV."):
            bucket = subject.split(".")[1]
            op = headers.get("KV-Operation")
            if op is None:
                op = "create" if headers.get("Nats-Expected-Last-Subject-Sequence") == "0" else (
                    "update" if "Nats-Expected-Last-Subject-Sequence" in headers else "put")
            return f"JetStream write: {bucket} {op.lower()}"
        if subject.startswith("$JS.API."):
            return "JetStream API: " + ".".join(subject.split(".")[2:4])
        if subject.startswith("$JS.EVENT."):
            return "JetStream advisory: " + ".".join(subject.split(".")[3:5])
        if subject.startswith("kvpush."):
            parts = subject.split(".")
            if parts[1] in ("generate", "cancel", "final", "invalid") or subject == "kvpush.scheduler.status":
                return {"generate": "GenerateRequest", "cancel": "CancelRequest", "final": "FinalRequest",
                        "invalid": "InvalidMessage", "scheduler": "SchedulerStatus request"}[parts[1]]
            try:
                kind = msgspec.msgpack.decode(msg.data).get("type", "?")
            except Exception:
                kind = "?"
            if kind == "RequestProgress":
                try:
                    kind += " " + msgspec.msgpack.decode(msg.data).get("stage", "")
                except Exception:
                    pass
            if kind == "AgentInfo" or parts[1:3] == ["kv", "agent"]:
                kind = "AgentInfo announcement" if parts[2] == "agents" else "AgentInfo request"
            return kind
        return "other: " + ".".join(subject.split(".")[:2])

    async def _on_message(self, msg) -> None:
        if not self.active:
            return
        kind = self._kind(msg)
        # A request's reply subject: its next message answers it. Not the client's inbox, which
        # takes the whole stream, nor a chunk's probe, which hears only "no responders".
        if msg.reply and not msg.reply.startswith("$JS.ACK.") and kind not in ("GenerateRequest",
                                                                               "TokenChunk -> client"):
            self._replies[msg.reply] = kind
            while len(self._replies) > 100_000:
                self._replies.popitem(last=False)
        row = self.counts[kind]
        row[0] += 1
        row[1] += len(msg.data)
        row[2] += _header_bytes(msg.headers)
        row[3] += len(msg.subject) + len(msg.reply)

    def report(self, requests: int, seconds: float) -> dict:
        per_request, periodic = {}, {}
        for kind, (count, payload, header, names) in sorted(self.counts.items()):
            row = {"messages": count, "payload_bytes": payload, "header_bytes": header, "subject_bytes": names}
            if kind in self.PERIODIC:
                periodic[kind] = {**row, "messages_per_s": round(count / seconds, 2),
                                  "payload_bytes_per_message": round(payload / count, 1)}
            else:
                per_request[kind] = {**row, "messages_per_request": round(count / requests, 3),
                                     "payload_bytes_per_request": round(payload / requests, 1),
                                     "header_bytes_per_request": round(header / requests, 1)}
        total = [sum(r[i] for k, r in self.counts.items() if k not in self.PERIODIC) for i in range(4)]
        return {"requests": requests, "seconds": round(seconds, 3), "per_request": per_request, "periodic": periodic,
                "total_per_request": {"messages": round(total[0] / requests, 2),
                                      "payload_bytes": round(total[1] / requests, 1),
                                      "header_bytes": round(total[2] / requests, 1),
                                      "subject_bytes": round(total[3] / requests, 1)}}


# --------------------------------------------------------------------------- one point


def percentile(values: list[float], q: float) -> float | None:
    value = stats.percentile(values, q)
    return None if math.isnan(value) else round(value, 3)


def code_state() -> dict:
    """The commit the scheduler ran from, and the files of kvpush's own code changed from it."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "services", "shared", "connector", "otel"],
                                 cwd=root, capture_output=True, text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "changed": None}
    return {"commit": commit or None, "changed": [line[3:] for line in changed]}


def machine_state() -> dict:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "nproc": len(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _busy_s() -> float:
    """CPU seconds the whole machine spent busy (every process, ours and others')."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def parse_topology(text: str) -> tuple[int, int]:
    """``"8P8D"`` (or ``"8x8"``) -> (8, 8)."""
    cleaned = text.strip().upper().replace("X", "P")
    if cleaned.endswith("D"):
        cleaned = cleaned[:-1]
    prefill, _, decode = cleaned.partition("P")
    if not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1 or int(decode) < 1:
        raise ValueError(f"a topology is like 1P1D or 8P8D, not {text!r}")
    return int(prefill), int(decode)


async def _wait_for_workers(nc, prefill_ids: list[str], decode_ids: list[str], processes, timeout: float) -> None:
    """Until every scheduler routes to every stand-in (each answers ``kvpush.scheduler.status``)."""
    deadline = time.monotonic() + timeout
    while True:
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a scheduler exited with {process.returncode} before it was ready")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        ready = set()
        try:
            await nc.publish(wire.SCHEDULER_STATUS_SUBJECT, b"", reply=inbox)
            until = time.monotonic() + 0.5
            while time.monotonic() < until and len(ready) < len(processes):
                try:
                    msg = await sub.next_msg(timeout=max(0.01, until - time.monotonic()))
                except Exception:
                    break
                try:
                    status = wire.decode_json(msg.data, wire.SchedulerStatus)
                except Exception:  # "no responders": no scheduler listens yet
                    continue
                if set(prefill_ids) <= set(status.prefill_workers) and set(decode_ids) <= set(status.decode_workers):
                    ready.add(status.scheduler_id)
        finally:
            await sub.unsubscribe()
        if len(ready) >= len(processes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ready)} of {len(processes)} schedulers routed to all {len(prefill_ids)}P"
                               f"{len(decode_ids)}D stand-ins within {timeout:g} s")
        await asyncio.sleep(0.2)


async def _drive(nc, prompts: list[list[int]], start: int, load: _Load, keep: list | None) -> dict:
    """Send ``prompts`` (ids ``start``..) through the real client, ``load.concurrency`` in
    flight, none started after ``load.time_limit_s`` from now. What came back, checked."""
    import msgspec

    deadline = time.monotonic() + load.time_limit_s
    concurrency, output_tokens, vocab = load.concurrency, load.output_tokens, load.vocab
    request_timeout_s, run_tag = load.request_timeout_s, load.run_tag

    latencies: list[float] = []
    sent_at: dict[str, float] = {}
    ok_ids: list[str] = []
    errors: dict[str, int] = defaultdict(int)
    wrong: list[str] = []
    index = 0
    started = 0

    async def client() -> None:
        nonlocal index, started
        while index < len(prompts) and time.monotonic() < deadline:
            i = index
            index += 1
            started += 1
            prompt = prompts[i]
            request_id = f"{run_tag}-{start + i}"
            body = {"prompt_token_ids": prompt, "max_tokens": output_tokens, "ignore_eos": True,
                    "request_id": request_id}
            tokens: list[int] = []
            chunks: list[int] = []
            final: wire.LastMessage | None = None
            error = ""
            began = time.perf_counter()
            sent_at[request_id] = time.monotonic()
            try:
                async for reply in generate(nc, body, timeout=request_timeout_s):
                    match reply:
                        case wire.TokenChunk():
                            tokens.extend(reply.token_ids)
                            chunks.append(reply.seq)
                        case _:
                            final = reply
            except Exception as exc:  # counted: a bench reports failures, it does not stop at one
                error = type(exc).__name__
            took_ms = (time.perf_counter() - began) * 1000
            match final:
                case wire.ErrorReply(error=said) if not error:
                    error = said.code
            if error:
                errors[error] += 1
            else:
                expected = expected_tokens(prompt, output_tokens, vocab)
                good = (tokens == expected and chunks == list(range(len(expected)))
                        and isinstance(final, wire.FinalReply) and final.finished
                        and final.usage.completion_tokens == len(expected)
                        and final.chunks == len(expected) and final.request_id == request_id)
                if good:
                    latencies.append(took_ms)
                    ok_ids.append(request_id)
                else:
                    wrong.append(request_id)
            if keep is not None:
                keep.append({"request_id": request_id, "prompt": prompt, "tokens": tokens, "chunks": chunks,
                             "final": msgspec.to_builtins(final) if final is not None else {}, "error": error,
                             "latency_ms": round(took_ms, 3)})

    began = time.monotonic()
    await asyncio.gather(*(client() for _ in range(max(1, concurrency))))
    return {"started": started, "latencies": latencies, "errors": dict(errors), "wrong": wrong, "sent_at": sent_at,
            "ok_ids": ok_ids,
            "wall_s": time.monotonic() - began, "stopped_by": "count" if started == len(prompts) else "time"}


DRAIN_TIMEOUT_S = 120.0  # how long the bench waits, after the last final, for the scheduler to end every request


class _LedgerWatch:
    """When the scheduler is done with each request: the delete of its flight record (a
    plain subscription on the bucket's subjects sees every write), and the flights it
    holds, from its heartbeats."""

    def __init__(self, run_tag: str):
        self.prefix = f"$KV.kvpush_flights.p.{run_tag}-"  # request ids are <run tag>-<n>, sent anonymously
        self.done: dict[str, float] = {}
        self.max_flights = 0  # the most flights the schedulers held together, from their heartbeats
        self.max_by_scheduler: dict[str, int] = {}
        self._latest: dict[str, int] = {}
        self._from = 0.0
        self._measuring = False
        self._count = asyncio.Event()

    async def start(self, nc) -> None:
        async def on_write(msg) -> None:
            if (self._measuring and msg.subject.startswith(self.prefix) and msg.headers
                    and msg.headers.get("KV-Operation") == "DEL"):
                self.done[msg.subject[len("$KV.kvpush_flights.p."):]] = time.monotonic()
                self._count.set()

        async def on_beat(msg) -> None:
            try:
                beat = wire.decode(msg.data, wire.SchedulerHeartbeat)
            except Exception:
                return
            if self._measuring:
                self._latest[beat.scheduler_id] = beat.flights
                self.max_by_scheduler[beat.scheduler_id] = max(self.max_by_scheduler.get(beat.scheduler_id, 0),
                                                               beat.flights)
                self.max_flights = max(self.max_flights, sum(self._latest.values()))

        await nc.subscribe("$KV.kvpush_flights.>", cb=on_write)
        await nc.subscribe(wire.SCHEDULER_HEARTBEATS.wildcard, cb=on_beat)
        await nc.flush()

    def since(self, at: float) -> None:
        self._from, self._measuring = at, True

    def done_count(self, ids: set[str]) -> int:
        return sum(1 for r in ids if r in self.done)

    async def wait_all(self, ids: set[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.done_count(ids) < len(ids):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._count.clear()
            try:
                await asyncio.wait_for(self._count.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        return True

    def last_done_s(self, ids: set[str]) -> float:
        times = [self.done[r] for r in ids if r in self.done]
        return max(times) - self._from if times else 0.0

    def done_latencies_ms(self, sent_at: dict[str, float]) -> list[float]:
        return [(self.done[r] - t) * 1000 for r, t in sent_at.items() if r in self.done]


async def _bucket_state(nc) -> dict:
    js = nc.jetstream(timeout=5.0)
    state = {}
    for bucket, stream in ((wire.FLIGHTS_BUCKET, f"KV_{wire.FLIGHTS_BUCKET}"), (wire.CLAIMS_STREAM_PREFIX, wire.claims_stream("decode-0")),
                           (wire.FINALS_BUCKET, f"KV_{wire.FINALS_BUCKET}")):
        try:
            info = await js.stream_info(stream)
            state[bucket] = {"messages": info.state.messages, "bytes": info.state.bytes}
        except Exception as exc:
            state[bucket] = {"error": type(exc).__name__}
    return state


async def run_point(model: str, prefill: int, decode: int, concurrency: int, requests: int, *, warmup: int,
                    time_limit_s: float, prompt_tokens: int, output_tokens: int, vocab: int, seed: int,
                    count_subjects: bool = False, quiet_scheduler: bool = False, keep_requests: bool = False,
                    request_timeout_s: float = 30.0, schedulers: int = 1, block_size: int = BLOCK_SIZE,
                    progress=lambda line: None) -> dict:
    """``schedulers`` schedulers (one unless asked), ``prefill`` x ``decode`` stand-ins, ``requests`` requests at
    ``concurrency`` in flight, on a fresh nats-server. Bounded: no request starts after
    ``time_limit_s`` of load, and none waits longer than ``request_timeout_s``."""
    import nats

    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(warmup + requests)]
    run_tag = f"sr{uuid.uuid4().hex[:6]}"
    load = _Load(concurrency, time_limit_s, output_tokens, vocab, request_timeout_s, run_tag)
    before_setup = machine_state()
    with tempfile.TemporaryDirectory(prefix="kvpush-bench-scheduler-") as tmp, LocalNatsServer() as server:
        rig = _Rig(*_start_schedulers(server.url, Path(tmp), run_tag, schedulers, model, quiet_scheduler))
        try:
            rig.workers = [IdlePrefill(server.url, f"prefill-{i}", vocab, block_size) for i in range(prefill)]
            rig.workers += [IdleDecode(server.url, f"decode-{i}", vocab, output_tokens, block_size)
                            for i in range(decode)]
            nc = await nats.connect(server.url, name="bench-client")
            rig.connections.append(nc)
            await _wait_for_workers_started(rig.workers)
            await _wait_for_workers(nc, [w.worker_id for w in rig.workers if w.role == "prefill"],
                                    [w.worker_id for w in rig.workers if w.role == "decode"], rig.processes,
                                    timeout=90.0)
            progress(f"{prefill}P{decode}D c={concurrency}: scheduler ready, warming up ({warmup} requests)")
            if warmup:
                warm = await _drive(nc, prompts[:warmup], 0, load, None)
                if warm["errors"] or warm["wrong"]:
                    raise RuntimeError(f"warm-up requests failed: {warm['errors']} wrong {warm['wrong'][:5]}")
            measured = await _measure(rig, server, nc, prompts[warmup:], warmup, load, count_subjects, keep_requests)
            for process in rig.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a scheduler exited with {process.returncode} during the run")
        except BaseException:
            for log_path in rig.log_paths:
                tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                progress(f"{log_path.stem} log tail:\n{tail}")
            raise
        finally:
            await rig.close()
    shape = {"topology": f"{prefill}P{decode}D", "prefill": prefill, "decode": decode, "concurrency": concurrency,
             "requests": requests, "warmup": warmup, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
             "block_size": block_size, "time_limit_s": time_limit_s}
    return _point(shape, measured, rig, quiet_scheduler, before_setup)


@dataclass(frozen=True)
class _Load:
    """How a point's client sends its requests (``_drive``)."""

    concurrency: int
    time_limit_s: float  # no request starts after this many seconds of the load
    output_tokens: int
    vocab: int
    request_timeout_s: float
    run_tag: str  # request ids are <run tag>-<n>


@dataclass
class _Rig:
    """One point's scheduler processes (and their logs), stand-ins and connections;
    ``close`` stops them all."""

    scheduler_ids: list[str]
    log_paths: list[Path]
    processes: list[subprocess.Popen]
    workers: list[_IdleWorker] = field(default_factory=list)
    connections: list = field(default_factory=list)

    async def close(self) -> None:
        for worker in self.workers:
            try:
                await worker.close()
            except Exception:
                pass
        for conn in self.connections:
            if not conn.is_closed:
                await conn.close()
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _start_schedulers(url: str, tmp: Path, run_tag: str, schedulers: int, model: str,
                      quiet: bool) -> tuple[list[str], list[Path], list[subprocess.Popen]]:
    """``schedulers`` ``kvpush scheduler`` processes, each logging to a file under ``tmp``:
    (their ids, their logs, the processes)."""
    env = {**os.environ, "KVPUSH_TRACE_DIR": str(tmp / "traces"), "KVPUSH_LOG_LEVEL": "INFO"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    if quiet:
        env.update(KVPUSH_LOG_LEVEL="WARNING", OTEL_SDK_DISABLED="true")
    scheduler_ids = [f"bench-scheduler-{run_tag}-{n}" for n in range(schedulers)]
    log_paths = [tmp / f"{scheduler_id}.log" for scheduler_id in scheduler_ids]
    processes = []
    for scheduler_id, log_path in zip(scheduler_ids, log_paths):
        with open(log_path, "wb") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "kvpush.services.cli.main", "scheduler", "--nats-url", url, "--model",
                 model, "--scheduler-id", scheduler_id, "--log-level", env["KVPUSH_LOG_LEVEL"]],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    return scheduler_ids, log_paths, processes


class _CpuClock:
    """CPU seconds used so far: (the schedulers' sum, nats-server's, this bench's, each scheduler's)."""

    def __init__(self, scheduler_pids: list[int], nats_pid: int):
        import psutil

        self._schedulers = [psutil.Process(pid) for pid in scheduler_pids]
        self._nats, self._me = psutil.Process(nats_pid), psutil.Process()

    def now(self) -> tuple[float, float, float, list[float]]:
        each = [_cpu_s(proc) for proc in self._schedulers]
        return sum(each), _cpu_s(self._nats), _cpu_s(self._me), each


@dataclass
class _Measured:
    """What a point's measured requests did, and what the machine spent on them."""

    requests: dict  # _drive's account
    ids: set[str]  # the requests answered right (refused ones have no flight to end)
    ledger: _LedgerWatch
    drained: bool  # the schedulers were done with every request within DRAIN_TIMEOUT_S
    behind_at_last_final: int  # requests the schedulers were not done with at the client's last final
    cpu_before: tuple
    cpu_at_last_final: tuple
    cpu_after: tuple
    busy_s: float  # the whole machine's busy CPU seconds over the span
    machine_start: dict
    machine_end: dict
    jobs_before: dict[str, int]
    buckets_before: dict
    buckets_after: dict
    subjects: dict | None  # SubjectCounter's report, when counted
    detail: list | None  # every request, when kept


async def _measure(rig: _Rig, server, nc, prompts: list[list[int]], first: int, load: _Load,
                   count_subjects: bool, keep_requests: bool) -> _Measured:
    """Send the measured requests (ids from ``first``) and wait until the schedulers are done
    with them, measuring the CPU the schedulers, nats-server and this bench spent."""
    import nats

    ledger = _LedgerWatch(load.run_tag)  # when the scheduler is done with each request: its flight deleted
    await ledger.start(nc)
    counter = None
    if count_subjects:
        counter = SubjectCounter()
        counter_nc = await nats.connect(server.url, name="bench-counter")
        rig.connections.append(counter_nc)
        await counter.start(counter_nc)
        await counter_nc.flush()
    await asyncio.sleep(1.5)  # the warm-up's last JetStream writes land before the count starts
    jobs_before = {w.worker_id: w.jobs for w in rig.workers}
    buckets_before = await _bucket_state(nc)
    clock = _CpuClock([process.pid for process in rig.processes], server.process.pid)
    machine_start, cpu_before, busy_before = machine_state(), clock.now(), _busy_s()
    if counter is not None:
        counter.active = True
    counted_from = time.monotonic()
    keep = [] if keep_requests else None
    ledger.since(time.monotonic())
    measured = await asyncio.wait_for(_drive(nc, prompts, first, load, keep),
                                      load.time_limit_s + load.request_timeout_s + 30)
    cpu_at_last_final = clock.now()
    ids = set(measured["ok_ids"])
    behind_at_last_final = len(ids) - ledger.done_count(ids)
    drained = await ledger.wait_all(ids, timeout=DRAIN_TIMEOUT_S)
    cpu_after, busy_after, machine_end = clock.now(), _busy_s(), machine_state()
    subjects = None
    if counter is not None:
        await asyncio.sleep(1.0)  # the last requests' trailing writes (final kept, flight deleted)
        counter.active = False
        subjects = counter.report(max(len(measured["latencies"]), 1), time.monotonic() - counted_from)
    buckets_after = await _bucket_state(nc)
    return _Measured(measured, ids, ledger, drained, behind_at_last_final, cpu_before, cpu_at_last_final, cpu_after,
                     busy_after - busy_before, machine_start, machine_end, jobs_before, buckets_before, buckets_after,
                     subjects, keep)


def _point(shape: dict, m: _Measured, rig: _Rig, quiet_scheduler: bool, before_setup: dict) -> dict:
    """A point's result: ``shape`` (what was asked), then what was measured."""
    measured = m.requests
    ok = len(measured["latencies"])
    wall = measured["wall_s"]
    done_wall = m.ledger.last_done_s(m.ids) if m.drained else None
    per_scheduler = [round(a - b, 3) for a, b in zip(m.cpu_after[3], m.cpu_before[3])]
    cpu = [a - b for a, b in zip(m.cpu_after[:3], m.cpu_before[:3])]
    others_s = max(0.0, m.busy_s - sum(cpu))
    done_ms = m.ledger.done_latencies_ms(measured["sent_at"])
    point = {
        **shape,
        "stopped_by": measured["stopped_by"], "started": measured["started"],
        "ok": ok, "errors": measured["errors"], "wrong": len(measured["wrong"]), "wrong_ids": measured["wrong"][:20],
        "wall_s": round(wall, 3), "rate_rps": round(ok / wall, 2) if wall > 0 else 0.0,
        "scheduler_done": {
            "what": "the scheduler is done with a request when it deleted its flight record (after keeping its "
                    "final): the client has its final earlier, from the decode",
            "all_done": m.drained, "wall_s": round(done_wall, 3) if done_wall else None,
            "rate_rps": round(ok / done_wall, 2) if done_wall else None,
            "behind_at_last_final": m.behind_at_last_final,
            "latency_ms": {"p50": percentile(done_ms, 0.5), "p99": percentile(done_ms, 0.99)},
            "max_flights_in_heartbeats": m.ledger.max_flights,
            "max_flights_by_scheduler": m.ledger.max_by_scheduler},
        "latency_ms": {"p50": percentile(measured["latencies"], 0.5), "p90": percentile(measured["latencies"], 0.9),
                       "p99": percentile(measured["latencies"], 0.99),
                       "max": round(max(measured["latencies"]), 3) if ok else None},
        "cpu_s_at_last_final": {name: round(a - b, 3) for name, a, b in
                                zip(("scheduler", "nats_server", "bench_driver"), m.cpu_at_last_final[:3],
                                    m.cpu_before[:3])},
        "schedulers": len(rig.scheduler_ids), "cpu_s_per_scheduler": dict(zip(rig.scheduler_ids, per_scheduler)),
        "cpu_s": {"scheduler": round(cpu[0], 3), "nats_server": round(cpu[1], 3), "bench_driver": round(cpu[2], 3)},
        "cpu_ms_per_request": {name: round(value * 1000 / ok, 3) if ok else None
                               for name, value in zip(("scheduler", "nats_server", "bench_driver"), cpu)},
        "cpu_s_per_s": {name: round(value / (done_wall or wall), 3) if (done_wall or wall) > 0 else None
                        for name, value in zip(("scheduler", "nats_server", "bench_driver"), cpu)},
        "others_cpu_s_per_s": round(others_s / (done_wall or wall), 3) if (done_wall or wall) > 0 else None,
        "others_cpu_measured_as": "the machine's busy CPU time (psutil.cpu_times, all cores) less that of the "
                                  "scheduler, nats-server and this bench, over the same span: other users' load",
        "cpu_measured_as": "psutil cpu_times (user + system) of the scheduler process(es) (`kvpush scheduler`, "
                           "each its own process, summed), of nats-server, and of this bench process (client and "
                           "stand-ins together), "
                           "from the measurement's start until the scheduler was done with every request; "
                           "per request: over the requests answered right",
        "scheduler_config": "quiet: log level WARNING, OTEL_SDK_DISABLED=true" if quiet_scheduler else
                            "as shipped: log level INFO, spans to local files (no OTLP endpoint)",
        "jobs_per_worker": {w.worker_id: w.jobs - m.jobs_before[w.worker_id] for w in rig.workers},
        "stand_ins": {w.worker_id: _stand_in_counts(w) for w in rig.workers},
        "jetstream_before": m.buckets_before, "jetstream_after": m.buckets_after,
        "machine_before_setup": before_setup, "machine_start": m.machine_start, "machine_end": m.machine_end,
    }
    if m.subjects is not None:
        point["subjects"] = m.subjects
    if m.detail is not None:
        point["detail"] = m.detail
    return point


async def _wait_for_workers_started(workers: list[_IdleWorker]) -> None:
    await asyncio.gather(*(w.start() for w in workers))


def _stand_in_counts(worker: _IdleWorker) -> dict:
    names = ("jobs", "cancels", "renewals", "agent_requests", "transfers", "refused", "finals", "fenced", "kv_timeouts")
    return {name: getattr(worker, name) for name in names if hasattr(worker, name)}


# --------------------------------------------------------------------------- the command


def markdown(results: dict) -> str:
    lines = ["| topology | concurrency | ok / sent | refused | client req/s | scheduler-done req/s | p50 ms | p99 ms | "
             "flights held (max) | scheduler CPU ms/req | scheduler CPU s/s | nats-server CPU ms/req | "
             "bench CPU ms/req | others' CPU s/s | loadavg start → end | nproc |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for p in results["points"]:
        load = f"{p['machine_start']['loadavg'][0]} → {p['machine_end']['loadavg'][0]}"
        done = p["scheduler_done"]
        lines.append(f"| {p['topology']} | {p['concurrency']} | {p['ok']}/{p['started']} | "
                     f"{sum(p['errors'].values())} | {p['rate_rps']} | {done['rate_rps']} | "
                     f"{p['latency_ms']['p50']} | {p['latency_ms']['p99']} | {done['max_flights_in_heartbeats']} | "
                     f"{p['cpu_ms_per_request']['scheduler']} | {p['cpu_s_per_s']['scheduler']} | "
                     f"{p['cpu_ms_per_request']['nats_server']} | {p['cpu_ms_per_request']['bench_driver']} | "
                     f"{p['others_cpu_s_per_s']} | {load} | {p['machine_start']['nproc']} |")
    return "\n".join(lines)


def cmd(args) -> int:
    for name in ("requests", "warmup", "prompt_tokens", "output_tokens", "schedulers", "block_size"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            print(f"--{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    try:
        topologies = [parse_topology(t) for t in args.topologies.split(",")]
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError as exc:
        print(f"kvpush bench-scheduler: {exc}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir("small")))
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])

    def say(line: str) -> None:
        print(f"[bench-scheduler] {line}", file=sys.stderr, flush=True)

    results = {"settings": {k: v for k, v in vars(args).items() if k != "func"},
               "machine": {**machine_state(), "python": sys.version.split()[0]}, "code": code_state(),
               "points": [], "errors": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for prefill, decode in topologies:
        for concurrency in concurrencies:
            try:
                point = asyncio.run(run_point(
                    model, prefill, decode, concurrency, args.requests, warmup=args.warmup,
                    time_limit_s=args.time_limit_s, prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens, vocab=vocab, seed=args.seed,
                    count_subjects=args.count_subjects, quiet_scheduler=args.scheduler_quiet,
                    keep_requests=args.detail, request_timeout_s=args.request_timeout_s,
                    schedulers=args.schedulers, block_size=args.block_size, progress=say))
            except Exception as exc:
                say(f"{prefill}P{decode}D c={concurrency} failed: {type(exc).__name__}: {exc}")
                results["errors"].append({"topology": f"{prefill}P{decode}D", "concurrency": concurrency,
                                          "error": f"{type(exc).__name__}: {exc}"})
                continue
            results["points"].append(point)
            say(f"{point['topology']} c={concurrency}: {point['ok']}/{point['started']} ok, {point['rate_rps']} req/s, "
                f"p50 {point['latency_ms']['p50']} ms, p99 {point['latency_ms']['p99']} ms, scheduler "
                f"{point['cpu_ms_per_request']['scheduler']} CPU-ms/req, loadavg {point['machine_end']['loadavg']}")
            (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    print(markdown(results))
    failed = results["errors"] or any(p["errors"] or p["wrong"] or not p["ok"] for p in results["points"])
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpush bench-scheduler", description=__doc__.split("\n\n")[0])
    scheduler_rate_arguments(parser)
    return cmd(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
