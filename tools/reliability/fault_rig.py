"""A kvpush stack to break on purpose, for the fault-injection suite, the hostile-peer
suite and ``kvpush soak``: real NATS with mutual TLS and one NATS user per worker,
scheduler and client (``kvpush.shared.permissions``, as ``kvpush nats-config`` writes it), real
vLLM engines, real NIXL, short leases and deadlines.

The rig connects as the identity allowed to do each thing: ``client`` (client-0) sends
requests, ``scheduler`` (scheduler-rig, a second scheduler identity) watches heartbeats,
progress, completions and refused messages and sends jobs, ``prefill`` and ``decode``
log in as the serving workers' own users to inject what only they may publish. The
``hostile`` identities (prefill-9, decode-9, client-9) are authenticated peers with no
part in any request: what they try must change nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats

from kvpush.tools import dev_certs
from kvpush.client import generate, scheduler_status
from kvpush.services.launch.natsd import LocalNatsServer
from kvpush.services.launch.stack import Stack
from kvpush.shared import chaos, wire
from kvpush.shared.block_keys import block_keys
from kvpush.shared.nats_security import connect_options, server_urls
from kvpush.shared.permissions import Identity, literal_password, new_password, render_config

# (role, NATS user): the stack's own services, the rig's watcher, and the hostile peers.
IDENTITIES = [
    Identity("scheduler", "scheduler-0", new_password()),
    Identity("scheduler", "scheduler-1", new_password()),
    Identity("prefill", "prefill-0", new_password()),
    Identity("prefill", "prefill-1", new_password()),  # a second prefill, for rigs that start two
    Identity("decode", "decode-0", new_password()),
    Identity("decode", "decode-1", new_password()),  # a second decode, for rigs that start two
    Identity("client", "client-0", new_password()),
    Identity("scheduler", "scheduler-rig", new_password()),
    Identity("prefill", "prefill-9", new_password()),
    Identity("decode", "decode-9", new_password()),
    Identity("client", "client-9", new_password()),
]
BY_NAME = {identity.name: identity for identity in IDENTITIES}
HOSTILE = {"prefill-9", "decode-9", "client-9"}
# The rig's connections: what each is for -> the identity it logs in as.
CONNECTIONS = {"scheduler": "scheduler-rig", "client": "client-0", "prefill": "prefill-0", "decode": "decode-0",
               "prefill-9": "prefill-9", "decode-9": "decode-9", "client-9": "client-9"}

# Short on purpose, so faults resolve within a test; the deadline leaves room for a
# replacement engine to start (30-60 s here) when a request is retried.
FAULT_ENV = {
    "KVPUSH_DEADLINE_S": "150",
    "KVPUSH_WORKER_TIMEOUT_S": "3",
    "KVPUSH_LEASE_S": "3",
    "KVPUSH_KV_WAIT_S": "15",
    "KVPUSH_QUARANTINE_S": "5",
    "KVPUSH_LOG_LEVEL": "INFO",
}
DEADLINE_S = float(FAULT_ENV["KVPUSH_DEADLINE_S"])
# nats-server resolves these against its config file's folder.
TLS_FILES = {"cert_file": "certs/server.pem", "key_file": "certs/server-key.pem", "ca_file": "certs/ca.pem"}


@dataclass
class Outcome:
    request_id: str
    tokens: list[int]
    final: wire.LastMessage
    seconds: float  # to the final message

    @property
    def code(self) -> str | None:
        match self.final:
            case wire.ErrorReply(error=error):
                return error.code
        return None


@dataclass
class Beat:
    free: int
    total: int
    role: str
    incarnation: str
    seen: float


@dataclass
class FaultRig:
    folder: Path
    model: str
    max_model_len: int
    decodes: int = 1
    prefills: int = 1
    worker_tp: dict[str, int] = field(default_factory=dict)  # worker name -> its engine's TP (else 1)
    extra_env: dict[str, str] = field(default_factory=dict)  # for every service, over FAULT_ENV
    prefix_caching: str = "on"  # the engines' (--prefix-caching)
    nats: LocalNatsServer | None = None
    stack: Stack | None = None
    certs: Path | None = None
    conns: dict[str, object] = field(default_factory=dict)
    beats: dict[str, Beat] = field(default_factory=dict)
    cached_keys: dict[str, set[bytes]] = field(default_factory=dict)  # worker id -> block keys its cache events stored
    progress: list[wire.RequestProgress] = field(default_factory=list)
    streaming_on: dict[str, str] = field(default_factory=dict)  # request id -> the decode that sent its last chunk
    invalid: list[wire.InvalidMessage] = field(default_factory=list)
    pushed: set[str] = field(default_factory=set)  # transfer ids prefill reported written
    written_bytes: Counter = field(default_factory=Counter)  # transfer id -> bytes prefill reported written
    killed: set[str] = field(default_factory=set)  # stack child names killed on purpose
    killed_processes: list = field(default_factory=list)  # the processes killed on purpose
    start_free: dict[str, int] = field(default_factory=dict)  # worker id -> its free blocks when idle
    incarnations: set[tuple[str, str]] = field(default_factory=set)  # (worker id, incarnation) ever seen

    # ------------------------------------------------------------------ setup

    def identity_env(self, name: str) -> dict[str, str]:
        return {
            "KVPUSH_NATS_USER": name,
            "KVPUSH_NATS_PASSWORD": BY_NAME[name].password,
            "KVPUSH_NATS_TLS_CA": str(self.certs / "ca.pem"),
            "KVPUSH_NATS_TLS_CERT": str(self.certs / "client.pem"),
            "KVPUSH_NATS_TLS_KEY": str(self.certs / "client-key.pem"),
        }

    async def start(self, extra_env: dict[str, str] | None = None) -> "FaultRig":
        self.nats = self.start_nats()
        options = self.stack_options()
        self.stack = Stack(
            self.model, nats_url=self.nats.url, prefill=self.prefills, decode=self.decodes,
            max_model_len=self.max_model_len, worker_tp=self.worker_tp,
            log_dir=self.folder / "logs", metrics=options.pop("metrics", True), prefix_caching=self.prefix_caching,
            extra_env={**FAULT_ENV, **self.chaos_env(), **self.extra_env, **(extra_env or {})},
            schedulers=2,  # sharing the load; either may die, and the other takes its requests over
            role_env={"scheduler": self.identity_env("scheduler-0"), "scheduler-1": self.identity_env("scheduler-1"),
                      "client": self.identity_env("client-0"),
                      **{f"prefill-{i}": self.identity_env(f"prefill-{i}") for i in range(self.prefills)},
                      **{f"decode-{i}": self.identity_env(f"decode-{i}") for i in range(self.decodes)},
                      **options.pop("role_env", {})},
            **options,
        )
        self.stack.start()
        for purpose in CONNECTIONS:
            self.conns[purpose] = await self.connect(purpose)
        watcher = self.conns["scheduler"]
        await watcher.subscribe(wire.HEARTBEATS.wildcard, cb=self._on_beat)
        await watcher.subscribe(wire.PROGRESS.wildcard, cb=self._on_progress)
        await watcher.subscribe(wire.TOKENS_SENT.wildcard, cb=self._on_tokens_sent)
        await watcher.subscribe(wire.INVALID_SUBJECT, cb=self._on_invalid)
        await watcher.subscribe(wire.COMPLETION_SUBJECTS, cb=self._on_completion)
        await watcher.subscribe(wire.CACHE_EVENTS.wildcard, cb=self._on_cache_events)
        await self.stack.wait_ready(timeout=400)
        for role in ("prefill", "decode"):
            self.start_free.update(await self.idle_free_blocks(role))
        return self

    def start_nats(self):
        """The rig's NATS (something with ``url``, ``stop()``, ``alive()``): one server
        with mutual TLS and the identities' users."""
        config_dir = self.folder / "nats"
        config_dir.mkdir(parents=True, exist_ok=True)
        self.certs = dev_certs.generate(config_dir / "certs")
        config = config_dir / "nats-server.conf"
        config.write_text(render_config(IDENTITIES, literal_password, tls=TLS_FILES))
        config.chmod(0o600)
        return LocalNatsServer(config=config).start()

    def stack_options(self) -> dict:
        """More of ``Stack``'s arguments, for a rig that places the services elsewhere."""
        return {}

    async def connect(self, purpose: str, errors: list[str] | None = None):
        """A connection for ``purpose`` (a key of CONNECTIONS), logged in as its identity;
        what the server refuses it (permission violations) is appended to ``errors``."""
        identity = BY_NAME[CONNECTIONS[purpose]]
        service = None if identity.role == "client" else identity.name

        async def on_error(exc) -> None:
            if errors is not None:
                errors.append(str(exc))

        return await nats.connect(server_urls(self.nats.url), max_reconnect_attempts=-1, reconnect_time_wait=0.2,
                                  error_cb=on_error,
                                  **connect_options(self.identity_env(identity.name), service=service))

    async def stop(self) -> None:
        for conn in self.conns.values():
            try:
                await conn.close()
            except Exception:
                pass
        if self.stack is not None:
            self.stack.stop()
        if self.nats is not None:
            self.nats.stop()

    async def _on_beat(self, msg) -> None:
        beat = _trusted(msg, wire.WorkerHeartbeat)
        if beat is None:
            return
        self.beats[beat.worker_id] = Beat(beat.free_kv_blocks, beat.total_kv_blocks, beat.role, beat.incarnation,
                                          time.monotonic())
        self.incarnations.add((beat.worker_id, beat.incarnation))

    async def _on_cache_events(self, msg) -> None:
        """What each engine's prefix cache holds, as the schedulers hear it."""
        if (event := _trusted(msg, wire.CacheEvents)) is None:
            return
        held = self.cached_keys.setdefault(event.worker_id, set())
        if event.cleared:
            held.clear()
        held.difference_update(event.removed)
        held.update(event.stored)

    def cached_blocks_known(self, worker_id: str, prompt: list[int], block_size: int = 128) -> int:
        """How many of ``prompt``'s first blocks ``worker_id``'s relayed cache events say it holds."""
        held = self.cached_keys.get(worker_id, set())
        count = 0
        for key in block_keys(prompt, block_size):
            if key not in held:
                break
            count += 1
        return count

    async def _on_progress(self, msg) -> None:
        if (event := _trusted(msg, wire.RequestProgress)) is not None:
            self.progress.append(event)

    async def _on_tokens_sent(self, msg) -> None:
        sent = _trusted(msg, wire.TokensSent)
        if sent is not None:
            self.streaming_on[sent.request_id] = sent.worker_id

    async def _on_invalid(self, msg) -> None:
        if (event := _decoded(msg, wire.InvalidMessage)) is not None:
            self.invalid.append(event)

    async def _on_completion(self, msg) -> None:
        event = _trusted(msg, wire.Completion)
        if isinstance(event, wire.TransferDone):
            self.pushed.add(event.transfer_id)
            self.written_bytes[event.transfer_id] += event.bytes

    # ------------------------------------------------------------------ message faults

    def chaos_env(self) -> dict[str, str]:
        return {"KVPUSH_CHAOS_FILE": str(self.folder / "chaos.json"), "KVPUSH_CHAOS_SEED": "7",
                "KVPUSH_CHAOS_LOG": str(self.folder / "chaos.log"), "KVPUSH_HOLD_FILE": str(self.holds)}

    # ------------------------------------------------------------------ held points

    @property
    def holds(self) -> Path:
        """The file naming the connector's points (``kvpush.shared.chaos.point``) where every
        engine's threads stop until it no longer names them."""
        return self.folder / "holds"

    def hold(self, *points: str) -> None:
        """Stop every engine's threads at ``points`` from now on (also engines started later)."""
        Path(chaos.reached_file(str(self.holds))).unlink(missing_ok=True)
        self.holds.write_text("".join(f"{point}\n" for point in points))

    def release(self) -> None:
        """Let every held thread go on."""
        self.holds.write_text("")

    async def wait_held(self, point: str, timeout: float) -> None:
        """Until some engine's thread stopped at ``point``."""
        reached = Path(chaos.reached_file(str(self.holds)))
        await wait_until(lambda: reached.exists() and point in reached.read_text().split(), timeout,
                         f"a thread held at {point}")

    def held_pids(self, point: str) -> list[int]:
        """The processes stopped at ``point`` so far."""
        reached = Path(chaos.reached_file(str(self.holds)))
        lines = reached.read_text().splitlines() if reached.exists() else []
        return [int(parts[1]) for parts in map(str.split, lines) if len(parts) == 2 and parts[0] == point]

    def kill_pid(self, pid: int) -> str:
        """kill -9 the stack's process ``pid`` (with its children); returns its stack name."""
        return self._kill(lambda name: dict(self.stack.children)[name].pid == pid, f"no stack process {pid}")

    def set_chaos(self, rates: dict | None) -> None:
        """Turn message faults on (rates per subject prefix) or off in every engine."""
        target = self.folder / "chaos.json"
        if rates is None:
            target.unlink(missing_ok=True)
            return
        staging = target.with_suffix(".tmp")
        staging.write_text(json.dumps(rates))
        staging.replace(target)

    async def apply_chaos(self, rates: dict | None) -> None:
        """``set_chaos``, returning once every engine reads the new rates: an engine looks at
        the file at most ``RELOAD_EVERY_S`` after its last look, so any message it sends
        after that bound goes out under them."""
        self.set_chaos(rates)
        await asyncio.sleep(chaos.RELOAD_EVERY_S + 0.1)

    def injected(self) -> Counter:
        log = self.folder / "chaos.log"
        return Counter(line.split()[0] for line in log.read_text().splitlines()) if log.exists() else Counter()

    async def assert_pushed(self, outcome: "Outcome", timeout: float = 10.0) -> None:
        """The KV of the request's last attempt was pushed by prefill (not recomputed by decode)."""
        def ended() -> list:
            return [p for p in self.progress if p.request_id == outcome.request_id and p.stage == "ended"]

        # Decode reports the end after the final reply, so the client can be first to know.
        await wait_until(ended, timeout, f"the end of {outcome.request_id} reported")
        await wait_until(lambda: ended()[-1].transfer_id in self.pushed, timeout,
                         f"the push of {outcome.request_id}'s KV")

    # ------------------------------------------------------------------ workers

    def live_workers(self, role: str, within_s: float = 2.5) -> dict[str, Beat]:
        now = time.monotonic()
        return {wid: b for wid, b in self.beats.items() if b.role == role and now - b.seen <= within_s}

    def _count(self, role: str) -> int:
        return self.decodes if role == "decode" else self.prefills

    async def idle_free_blocks(self, role: str, timeout: float = 60.0) -> dict[str, int]:
        """Free KV blocks of each live worker of ``role``, by worker id, once two beats agree
        (engines of one TP have the same number; a TP-2 engine's ranks each hold half the
        heads, so with the same KV space per rank it has twice as many)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            live = self.live_workers(role)
            free = {wid: b.free for wid, b in live.items()}
            if len(live) == self._count(role):
                if free == last:
                    return free
                last = free
            await asyncio.sleep(1.1)
        raise TimeoutError(f"no steady {role} heartbeats within {timeout} s")

    async def assert_blocks_back(self, timeout: float = 45.0, workers: set[str] | None = None) -> None:
        """Every engine's free KV block count returns to its starting value; with
        ``workers``, those workers' engines' (the others may be stopped or dead)."""
        deadline = time.monotonic() + timeout
        while True:
            live = {**self.live_workers("prefill"), **self.live_workers("decode")}
            now_free = {wid: beat.free for wid, beat in live.items()}
            expected = workers if workers is not None else set(self.start_free)
            if expected <= now_free.keys() and all(now_free[wid] == self.start_free[wid] for wid in expected):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"KV blocks not back: free now {now_free}, at start {self.start_free}")
            await asyncio.sleep(0.5)

    def pause(self, name: str) -> None:
        """SIGSTOP the stack's worker ``name`` and its engine processes: it stalls (no
        heartbeat, no reply) with everything it holds, until ``resume``."""
        self._signal_tree(name, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self._signal_tree(name, signal.SIGCONT)

    def pause_engine(self, name: str) -> None:
        """SIGSTOP only the engine processes of the stack's worker ``name``: its engine
        hangs while the worker process goes on heartbeating and answering."""
        self._signal_tree(name, signal.SIGSTOP, engine_only=True)

    def resume_engine(self, name: str) -> None:
        self._signal_tree(name, signal.SIGCONT, engine_only=True)

    def _signal_tree(self, name: str, signum: int, engine_only: bool = False) -> None:
        import psutil

        process = dict(self.stack.children)[name]
        tree = psutil.Process(process.pid)
        engines = tree.children(recursive=True)
        if engine_only and not engines:
            raise AssertionError(f"{name} has no engine process of its own")
        for member in engines if engine_only else [tree, *engines]:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signum)

    def kill(self, role: str) -> str:
        """kill -9 the live worker of ``role`` with its engine processes (a crash of the
        worker's machine or container); returns its stack name."""
        return self._kill(lambda name: name.startswith(role), f"no live {role} process to kill")

    def kill_worker(self, name: str) -> str:
        """kill -9 the stack's worker ``name`` (``decode-1``) with its engine processes."""
        return self._kill(lambda n: n == name, f"{name} is not running")

    def _kill(self, chosen, missing: str) -> str:
        import psutil

        for name, process in self.stack.children:
            if chosen(name) and process.poll() is None:
                tree = psutil.Process(process.pid)
                for member in [*tree.children(recursive=True), tree]:
                    try:
                        member.send_signal(signal.SIGKILL)
                    except psutil.NoSuchProcess:
                        pass
                process.wait()
                self.killed.add(name)
                self.killed_processes.append(process)
                return name
        raise AssertionError(missing)

    # The stack's name of each scheduler process, by its NATS user.
    SCHEDULER_PROCESSES = {"scheduler-0": "scheduler", "scheduler-1": "scheduler-1"}

    def kill_scheduler(self, scheduler_id: str) -> str:
        """kill -9 the scheduler that is ``scheduler_id`` (its NATS user)."""
        name = self.SCHEDULER_PROCESSES[scheduler_id]
        return self._kill(lambda n: n == name, f"scheduler {scheduler_id} is not running")

    async def restart_scheduler(self, scheduler_id: str, timeout: float = 60.0) -> None:
        """Start it again (its identity, a new incarnation) and wait for its heartbeat."""
        beats, sub = await self.observe("scheduler", wire.SCHEDULER_HEARTBEATS(sender=scheduler_id),
                                        wire.SchedulerHeartbeat)
        try:
            before = {beat.incarnation for beat in beats}
            self.stack.spawn_scheduler(self.SCHEDULER_PROCESSES[scheduler_id])
            await wait_until(lambda: {beat.incarnation for beat in beats} - before, timeout,
                             f"scheduler {scheduler_id} heartbeating again")
        finally:
            await sub.unsubscribe()

    async def holder_of(self, request_id: str) -> wire.FlightRecord | None:
        """The flight's record in JetStream (who holds it, which attempt), or None: a
        request of the rig's client."""
        js = self.conns["scheduler"].jetstream()
        try:
            entry = await (await js.key_value(wire.FLIGHTS_BUCKET)).get(
                wire.flight_key(CONNECTIONS["client"], request_id))
        except Exception:
            return None
        return wire.decode(entry.value, wire.FlightRecord) if entry.value else None

    def replace(self, role: str, name: str = "") -> str:
        """Start the killed worker again: the same identity (its NATS user), a new incarnation."""
        name = name or f"{role}-0"
        self.stack.spawn_worker(role, name)
        return name

    def live_incarnations(self, role: str) -> set[tuple[str, str]]:
        return {(wid, beat.incarnation) for wid, beat in self.live_workers(role).items()}

    async def wait_for_new_worker(self, role: str, old: set[tuple[str, str]], timeout: float = 400.0) -> str:
        """Wait for a live worker of ``role`` whose (id, incarnation) is not in ``old``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh = [wid for wid, incarnation in self.live_incarnations(role) if (wid, incarnation) not in old]
            if fresh:
                return fresh[0]
            self.assert_nothing_else_died()
            await asyncio.sleep(0.5)
        raise TimeoutError(f"no new {role} worker within {timeout} s")

    def assert_nothing_else_died(self) -> None:
        for name, process in self.stack.children:
            if process.poll() is not None and process not in self.killed_processes:
                raise AssertionError(f"{name} died (exit {process.returncode})")
        assert self.nats.alive(), "nats-server died"

    # ------------------------------------------------------------------ requests

    async def request(self, body: dict, on_reply=None, timeout: float = DEADLINE_S + 30,
                      drop_final: bool = False) -> Outcome:
        """Send one request as the client role; every reply until the final one. With
        ``drop_final`` the client loses the final as it comes, and must fetch it again."""
        body = {"ignore_eos": True, **body}
        body.setdefault("request_id", f"fault-{uuid.uuid4().hex[:10]}")
        started = time.monotonic()
        tokens: list[int] = []
        lost = (lambda reply: isinstance(reply, wire.TokenChunk)) if drop_final else None
        async for reply in generate(self.conns["client"], body, timeout=timeout, received=lost):
            match reply:
                case wire.TokenChunk():
                    tokens.extend(reply.token_ids)
                case _:
                    final = reply
            if on_reply is not None:
                await on_reply(reply)
        return Outcome(body["request_id"], tokens, final, time.monotonic() - started)

    def metric(self, service: str, name: str, engine_core: bool = False, **labels: str) -> float:
        """The sum of a Prometheus metric's samples with these labels, as ``service``'s
        /metrics (its engine core's: where its connector counts) says now (0 if it has none)."""
        address = self.stack.metrics_targets[service][1 if engine_core else 0]
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        wanted = [f'{key}="{value}"' for key, value in labels.items()]
        total = 0.0
        for line in text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample.split("{", 1)[0] == name and all(label in sample for label in wanted):
                total += float(value)
        return total

    # ------------------------------------------------------------------ faults

    async def workers(self) -> tuple[str, str]:
        """(prefill id, decode id) the scheduler routes to now."""
        status = await scheduler_status(self.conns["client"], timeout=5)
        return status.prefill_workers[0], status.decode_workers[0]

    async def send_malformed(self) -> set[str]:
        """Garbage on every subject, each sent by the role allowed to publish there;
        returns the subjects (each service should report a refusal on kvpush.invalid)."""
        prefill_id, decode_id = await self.workers()
        by_role = {
            "client": [wire.OWNED_CANCEL(client=CONNECTIONS["client"])],
            "scheduler": [wire.prefill_job_subject(prefill_id), wire.decode_job_subject(decode_id)],
            "prefill": [wire.HANDOFFS(sender=prefill_id), wire.completion_subject(decode_id, prefill_id),
                        wire.HEARTBEATS(sender=prefill_id), wire.KV_AGENTS(sender=prefill_id)],
            "decode": [wire.registration_subject(prefill_id, decode_id), wire.PROGRESS(sender=decode_id)],
        }
        for role, subjects in by_role.items():
            for subject in subjects:
                await self.conns[role].publish(subject, b"\xc1 not msgpack")
            await self.conns[role].flush()
        return {s for subjects in by_role.values() for s in subjects}

    async def forge_registration(self, prompt: list[int], block_ids: list[int] | None = None,
                                 engine: str | None = None, key: str = "rig-key") -> tuple[str, str, str]:
        """A prefill job (as the scheduler) and a registration for it naming blocks out of
        range (as the chosen decode, with the job's key), or from ``engine`` (a hostile
        decode identity, without the key) instead of the decode the job names. Returns
        (transfer id, prefill id, decode id)."""
        prefill_id, decode_id = await self.workers()
        transfer_id = uuid.uuid4().hex
        blocks = -(-len(prompt) // 128)
        sender = engine or decode_id
        registration = wire.Registration(
            transfer_id=transfer_id, request_id="forged", decode_engine_id=sender,
            decode_request_id="forged", decode_tp_size=1, block_ids=block_ids or [10**9] * blocks,
            num_tokens=len(prompt), registered_at=time.time(), transfer_key="" if engine else key)
        job = wire.PrefillJob(request_id="forged", transfer_id=transfer_id, prompt_token_ids=prompt,
                              received_at=time.time(), decode_engine_id=decode_id, transfer_key=key)
        conn = self.conns[engine] if engine else self.conns["decode"]
        await conn.publish(wire.registration_subject(prefill_id, sender), wire.encode(registration))
        ack = wire.decode((await self.conns["scheduler"].request(
            wire.prefill_job_subject(prefill_id), wire.encode(job), timeout=5)).data, wire.JobAck)
        assert ack.accepted, ack
        return transfer_id, prefill_id, decode_id

    async def drop_reply_subscription(self, body: dict) -> str:
        """A client that goes away mid-stream without cancelling; returns its request id."""
        client = self.conns["client"]
        request_id = f"gone-{uuid.uuid4().hex[:10]}"
        inbox = client.new_inbox()
        sub = await client.subscribe(inbox)
        request = {"ignore_eos": True, **body, "request_id": request_id}
        await client.publish(wire.OWNED_GENERATE(client=CONNECTIONS["client"]), json.dumps(request).encode(),
                             reply=inbox)
        try:
            await sub.next_msg(timeout=DEADLINE_S)  # the first chunk: it streams
        finally:
            await sub.unsubscribe()
        return request_id

    async def kill_and_replace(self, role: str) -> str:
        """kill -9 ``role``'s worker and start it again (its identity, a new incarnation);
        returns once the new incarnation heartbeats."""
        old = self.live_incarnations(role)
        self.replace(role, self.kill(role))  # the one killed, under its own name
        return await self.wait_for_new_worker(role, old)

    async def observe(self, role: str, subject: str, kind=None) -> tuple[list, object]:
        """Collect messages on ``subject`` (as ``role``) into a list; returns it and the sub."""
        seen: list = []

        async def on_msg(msg):
            seen.append(wire.decode(msg.data, kind) if kind else msg)

        sub = await self.conns[role].subscribe(subject, cb=on_msg)
        await self.conns[role].flush()
        return seen, sub


@contextlib.asynccontextmanager
async def running_rig(folder: Path, model: str, max_model_len: int, decodes: int = 1,
                      extra_env: dict[str, str] | None = None, prefix_caching: str = "on", prefills: int = 1,
                      worker_tp: dict[str, int] | None = None):
    """A started rig for a test module; on a failed start its services' logs go to stderr."""
    rig = FaultRig(folder, model, max_model_len, decodes=decodes, extra_env=extra_env or {},
                   prefix_caching=prefix_caching, prefills=prefills, worker_tp=worker_tp or {})
    try:
        await rig.start()
        yield rig
    except BaseException:
        for log in sorted((folder / "logs").glob("*.log")):
            sys.stderr.write(f"----- {log.name}\n{log.read_text()[-3000:]}\n")
        raise
    finally:
        await rig.stop()


def _trusted(msg, kind):
    """What the stack's own workers said: the rig believes what the services believe, and
    nothing from the hostile identities."""
    message = _decoded(msg, kind)
    if message is None or wire.forged_sender(msg.subject, message) or wire.sender_of(msg.subject) in HOSTILE:
        return None
    return message


def _decoded(msg, kind):
    """The rig watches subjects it also sends garbage to: skip what does not decode."""
    try:
        return wire.decode(msg.data, kind)
    except msgspec.MsgspecError:
        return None


async def wait_until(predicate, timeout: float, what: str):
    """What ``predicate()`` returned, once it is true."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout} s")
        await asyncio.sleep(0.05)
    return value
