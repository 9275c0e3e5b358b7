"""Hostile identities against JetStream (issue 24): a client, a prefill and a decode try every
``$JS.API``/``$KV`` path and every claim trick on the server ``kvpush nats-config`` generates,
and each attempt must end as the table says, *by the server's word*: a permissions violation
it reports (``denied``), a JetStream error it answers (``refused <err_code>``), or the answer
itself (``allowed``, ``not found``, ``status <code>``). A scheduler runs the same table as the
control: it may use the JetStream API, and the streams' own settings are all that stops it.

Claims live in a stream per decode (``wire.claims_stream``): a decode publishes claims only
in its own, ``kvpush.claims.<own>.<claim key>.decode.<own>``, and reads only those (a direct
get by subject); schedulers claim in any decode's stream and in their own ``kvpush_claims``
(attempts with no decode yet). Each hostile decode has its stream, made by a scheduler as
before a first job; a row says which stream it attacks: the victim decode's, the attacker's
own, or the schedulers'.

After every attempt the things attacked (a scheduler's flight, its stored final, its fence
on one attempt of the victim decode and on one attempt with no decode, the victim decode's
claim on another, and the four streams' settings) are read back as the observer and must be
as they were. The attacks the old design fell to (a KV bucket of claims that decodes wrote
through ``$KV.kvpush_claims.*``) are tests of their own, on the real ``Claims``: (a) a
rollup, (b) an oversized claim, (c) a claim under another's name, (d) a fenced decode, and
a decode whose ack was lost.

Two more ways in have tests of their own, each on a server of its own (they would wreck the
state they attack if they worked): a reply subject bounced off the attacker's own
subscription (workers once had ``allow_responses``; now the server denies the "response"),
and a decode that floods claims of its own (it fills only its own stream)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import nats
import nats.js.errors
import pytest

from kvpush.services.ledger import WRONG_LAST_SEQUENCE, Claim, ClaimState, Claims, Ledger
from kvpush.shared import wire
from tests.nats.deployed import NatsUnderTest

FLIGHTS = f"KV_{wire.FLIGHTS_BUCKET}"
FINALS = f"KV_{wire.FINALS_BUCKET}"
SCHEDULERS_CLAIMS = wire.claims_stream("")  # kvpush_claims: the attempts with no decode yet
OWNER, REQUEST_ID = "client-victim", "request-1"

# JetStream's error codes, as the server answers them
MESSAGE_TOO_LARGE = 10054
DELETE_NOT_PERMITTED = 10057
STREAM_NOT_FOUND = 10059
PURGE_NOT_PERMITTED = 10110
ROLLUP_NOT_PERMITTED = 10111
TTL_DISABLED = 10166

DENIED, ALLOWED, NOT_FOUND = "denied", "allowed", "not found"
ANSWER_S = 5.0  # an answer or a violation comes within milliseconds; this only bounds a failure
EIGHT_MIB = 8 * 1024 * 1024 - 4096  # under the server's max_payload (8 MiB) with a claim's headers


def refused(err_code: int) -> str:
    return f"refused {err_code}"


def status(code: int) -> str:
    return f"status {code}"


# ------------------------------------------------------------------ what is attacked


@dataclass
class Scene:
    """What a victim scheduler and a victim decode wrote, and the observer's eyes on it."""

    server: NatsUnderTest
    observer: nats.NATS
    ledger: Ledger  # the victim scheduler's
    scheduler: str
    decode: str
    decode_nc: nats.NATS
    fenced_transfer: str  # the victim scheduler holds this attempt's claim (a fence), in the victim decode's stream
    decoded_transfer: str  # the victim decode holds this one's, in its stream
    pending_transfer: str  # the victim scheduler holds this one's too: an attempt with no decode yet
    flight: str = ""
    fence: Claim | None = None
    held: Claim | None = None
    pending: Claim | None = None
    flight_revision: int = 0
    final_revision: int = 0
    before: dict = field(default_factory=dict)

    @property
    def fenced(self) -> str:
        return wire.claim_key(self.fenced_transfer)

    @property
    def decoded(self) -> str:
        return wire.claim_key(self.decoded_transfer)

    @property
    def pended(self) -> str:
        return wire.claim_key(self.pending_transfer)

    @property
    def victims(self) -> str:
        """The victim decode's claims stream."""
        return wire.claims_stream(self.decode)

    @property
    def streams(self) -> tuple[str, ...]:
        return FLIGHTS, FINALS, self.victims, SCHEDULERS_CLAIMS


async def stage(server: NatsUnderTest) -> Scene:
    """A scheduler makes the buckets, the schedulers' claims stream and the victim decode's
    (before that decode's first claim, as before its first job), and writes a flight, a final,
    a fence on an attempt of the victim decode and one on an attempt with no decode; the
    victim decode claims another attempt of its own."""
    scheduler, decode = server.identity("scheduler"), server.identity("decode")
    scheduler_nc = await server.connect(scheduler)
    ledger = await Ledger.open(scheduler_nc, me=wire.Claimant.scheduler(scheduler, "inc"))
    await ledger.claims.ensure_stream(decode)
    scene = Scene(server, await server.connect(server.observer()), ledger, scheduler, decode,
                  await server.connect(decode), "fenced-" + os.urandom(8).hex(), "decoded-" + os.urandom(8).hex(),
                  "pending-" + os.urandom(8).hex())
    now = time.time()
    flight = wire.FlightRecord(
        request_id=REQUEST_ID, owner=OWNER, reply_to=f"{wire.CLIENT_INBOX_PREFIX}.{OWNER}.r", received_at=now,
        deadline_at=now + 300, prompt_token_ids=[1, 2, 3], sampling=wire.SamplingSpec(4, 0.0, False),
        transfer_mode=None, holder=scheduler, holder_incarnation="inc", transfer_key=scene.fenced_transfer,
        decode_id=decode)
    scene.flight = wire.flight_key(OWNER, REQUEST_ID)
    scene.flight_revision = await ledger.record(flight)
    await ledger.keep_final(OWNER, REQUEST_ID, b'{"request_id": "request-1", "text": "the answer"}')
    scene.fence = await ledger.claim(scene.fenced_transfer, decode)
    scene.pending = await ledger.claim(scene.pending_transfer, "")
    scene.held = await Claims(scene.decode_nc, wire.Claimant.decode(decode)).claim(scene.decoded_transfer)
    assert scene.flight_revision and scene.fence.won and scene.pending.won and scene.held.won
    scene.before = await snapshot(scene)
    assert scene.before["final"] is not None
    assert None not in scene.before["streams"].values()
    scene.final_revision = scene.before["final"][1]
    return scene


async def close(scene: Scene) -> None:
    for nc in (scene.observer, scene.decode_nc, scene.ledger.claims.nc):
        await nc.close()


async def damage(scene: Scene) -> dict:
    """What an attack changed: {what: (before, after)}; empty when nothing."""
    after = await snapshot(scene)
    return {what: (scene.before[what], after[what]) for what in after if after[what] != scene.before[what]}


async def snapshot(scene: Scene) -> dict:
    """The attacked things as the observer reads them (None: gone)."""
    js = scene.observer.jetstream(timeout=ANSWER_S)
    settings = {}
    for name in scene.streams:
        try:
            config = (await js.stream_info(name)).config
        except nats.js.errors.NotFoundError:
            settings[name] = None
            continue
        settings[name] = (config.subjects, config.max_bytes, config.max_msg_size, config.max_msgs_per_subject,
                          config.discard, config.deny_delete, config.deny_purge, config.allow_rollup_hdrs)
    entries = {}
    for bucket in (wire.FLIGHTS_BUCKET, wire.FINALS_BUCKET):
        try:
            entry = await (await js.key_value(bucket)).get(scene.flight)
            entries[bucket] = (entry.value, entry.revision)
        except (nats.js.errors.NotFoundError, nats.js.errors.KeyNotFoundError, nats.js.errors.BucketNotFoundError):
            entries[bucket] = None
    claims = {"fence": None, "held": None, "pending": None}
    reader = Claims(scene.observer, wire.Claimant.scheduler(scene.server.observer(), "observer"))
    if settings[scene.victims] is not None:  # with no stream, a read would wait out an election
        claims |= {"fence": await reader.holder(scene.decode, scene.fenced),
                   "held": await reader.holder(scene.decode, scene.decoded)}
    if settings[SCHEDULERS_CLAIMS] is not None:
        claims["pending"] = await reader.holder("", scene.pended)
    return {"streams": settings, "flight": entries[wire.FLIGHTS_BUCKET], "final": entries[wire.FINALS_BUCKET],
            **claims}


# ------------------------------------------------------------------ attempts and verdicts


@dataclass
class Hostile:
    name: str
    nc: nats.NATS
    errors: list[str]

    def violated(self, kind: str, subject: str, since: int = 0) -> bool:
        wanted = f'permissions violation for {kind} to "{subject}"'.lower()
        return any(wanted in error.lower() for error in self.errors[since:])


async def hostile(server: NatsUnderTest, role: str, name: str | None = None) -> Hostile:
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    name = name or server.identity(role)
    return Hostile(name, await server.connect(name, error_cb=on_error, max_reconnect_attempts=0), errors)


async def hostile_decode(scene: Scene) -> Hostile:
    """A decode with a claims stream of its own, made by a scheduler as before its first job."""
    who = await hostile(scene.server, "decode")
    await scene.ledger.claims.ensure_stream(who.name)
    return who


@dataclass(frozen=True)
class Pub:
    subject: str
    body: bytes = b""
    headers: dict | None = None


@dataclass(frozen=True)
class Sub:
    subject: str


def settling(future: asyncio.Future):
    """A message callback that settles ``future`` with the first message."""
    async def on_msg(msg):
        if not future.done():
            future.set_result(msg)
    return on_msg


def verdict_of(msg) -> str:
    code = (msg.headers or {}).get("Status")
    if code == "404":
        return NOT_FOUND
    if code:
        return status(int(code))
    try:
        body = json.loads(msg.data) if msg.data else {}
    except ValueError:
        return ALLOWED  # a message's own bytes, from a get
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return refused(body["error"].get("err_code"))
    return ALLOWED


async def answer(who: Hostile, attempt: Pub | Sub) -> str:
    """The server's verdict on ``attempt``: whichever comes, the violation it reports or the
    answer on the attempt's reply subject (a refused publish reaches nobody, so never both)."""
    since = len(who.errors)
    if isinstance(attempt, Sub):
        await who.nc.subscribe(attempt.subject)
        await who.nc.flush()
        deadline = time.monotonic() + 1.0  # the violation precedes the flush's PONG; a margin anyway
        while time.monotonic() < deadline:
            if who.violated("subscription", attempt.subject, since):
                return DENIED
            await asyncio.sleep(0.02)
        return ALLOWED
    answered = asyncio.get_running_loop().create_future()
    inbox = who.nc.new_inbox()
    sub = await who.nc.subscribe(inbox, cb=settling(answered))
    try:
        await who.nc.publish(attempt.subject, attempt.body, reply=inbox, headers=attempt.headers)
        await who.nc.flush()
        deadline = time.monotonic() + ANSWER_S
        while time.monotonic() < deadline:
            if who.violated("publish", attempt.subject, since):
                return DENIED
            if answered.done():
                return verdict_of(answered.result())
            await asyncio.wait({answered}, timeout=0.02)
        return "no answer"
    finally:
        await sub.unsubscribe()


def fresh() -> str:
    return wire.claim_key(os.urandom(8).hex())


def claiming(decode_id: str, key: str, **more: str) -> dict:
    """A claim's headers (as ``Claims`` sends them): the first message over the attempt's."""
    return {"Nats-Expected-Last-Subject-Sequence": "0",
            "Nats-Expected-Last-Subject-Sequence-Subject": wire.claims_of(decode_id, key), **more}


def fence_of(scene: Scene) -> wire.Claimant:
    return wire.Claimant.scheduler(scene.scheduler, "inc")


def own(role: str, me: str) -> wire.Claimant:
    """Who ``me`` claims as: a scheduler as itself; anyone else as a decode of its name."""
    return wire.Claimant.scheduler(me, "inc") if role == "scheduler" else wire.Claimant.decode(me)


def home(scene: Scene, role: str, me: str) -> str:
    """The decode whose attempts ``me`` claims by right: a decode its own; a scheduler (and
    anyone else, who may claim nowhere) the victim decode's."""
    return me if role == "decode" else scene.decode


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def consumer(stream: str, **config) -> bytes:
    return body(stream_name=stream, config={"ack_policy": "none", "inactive_threshold": 1_000_000_000, **config})


def claim_of_own(scene, role, me, key, payload=b"", **headers) -> Pub:
    """``me``'s claim, as itself, on an attempt (claim key ``key``) of the decode it claims for."""
    decode = home(scene, role, me)
    return Pub(own(role, me).subject(decode, key), payload, claiming(decode, key, **headers))


def opened_claims_settings(decode_id: str) -> bytes:
    """``decode_id``'s claims stream's settings with rollups, purges and deletes let through."""
    config = Claims(None, wire.Claimant.decode("nobody")).stream_config(decode_id).as_dict()
    return json.dumps({**config, "allow_rollup_hdrs": True, "deny_purge": False, "deny_delete": False}).encode()


NO_DIRECT = status(503)  # the buckets are made without direct gets: nobody answers one
Attempt = Callable[[Scene, str, str], Pub | Sub]  # (scene, role, my name)
D = DENIED
# Every stream a row may attack, with the decode id of the claims streams' ("" the
# schedulers'); "its own" is a decode's own (a scheduler has none: not tried).
Where = Callable[[Scene, str], str]  # (scene, my name) -> stream
STREAMS: list[tuple[str, Where, bool]] = [  # (which, its name, does a scheduler try it)
    ("flights", lambda s, me: FLIGHTS, True),
    ("finals", lambda s, me: FINALS, True),
    ("the victim decode's claims", lambda s, me: s.victims, True),
    ("the schedulers' claims", lambda s, me: SCHEDULERS_CLAIMS, True),
    ("its own claims", lambda s, me: wire.claims_stream(me), False),
]
CLAIM_STREAMS: list[tuple[str, Callable[[Scene, str], str], bool]] = [  # (which, its decode id, ...)
    ("the victim decode's claims", lambda s, me: s.decode, True),
    ("the schedulers' claims", lambda s, me: "", True),
    ("its own claims", lambda s, me: me, False),
]


def as_scheduler(tried: bool, verdict: str) -> str | None:
    return verdict if tried else None


def claims_in(decode_id: str) -> str:
    return wire.claims_stream(decode_id)


def own_direct_get(scene: Scene, role: str, me: str, key: str, query: bytes = b"") -> Pub:
    """``me``'s direct get of its own claim on ``key``, in the stream of the decode it claims for."""
    decode = home(scene, role, me)
    return Pub(f"$JS.API.DIRECT.GET.{claims_in(decode)}.{own(role, me).subject(decode, key)}", query)


# (what is tried, the attempt, the verdict for a client, a prefill, a decode, a scheduler);
# None: not tried (a scheduler may wreck what it is trusted with)
TABLE: list[tuple[str, Attempt, tuple]] = [
    ("api info", lambda s, r, me: Pub("$JS.API.INFO"), (D, D, D, ALLOWED)),
    ("stream names", lambda s, r, me: Pub("$JS.API.STREAM.NAMES"), (D, D, D, ALLOWED)),
    *((f"stream info {which}", lambda s, r, me, where=where: Pub(f"$JS.API.STREAM.INFO.{where(s, me)}"),
       (D, D, D, as_scheduler(tried, ALLOWED))) for which, where, tried in STREAMS),
    ("msg get flights", lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{FLIGHTS}",
                                             body(last_by_subj=f"$KV.{wire.FLIGHTS_BUCKET}.{s.flight}")),
     (D, D, D, ALLOWED)),
    ("msg get finals", lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{FINALS}",
                                            body(last_by_subj=f"$KV.{wire.FINALS_BUCKET}.{s.flight}")),
     (D, D, D, ALLOWED)),
    ("msg get the fence (the victim decode's claims)",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{s.victims}", body(last_by_subj=wire.claims_of(s.decode, s.fenced))),
     (D, D, D, ALLOWED)),
    ("msg get the fence on an attempt with no decode (the schedulers' claims)",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{SCHEDULERS_CLAIMS}",
                          body(last_by_subj=wire.claims_of("", s.pended))),
     (D, D, D, ALLOWED)),
    ("msg get its own claims",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{claims_in(me)}", body(seq=1)), (D, D, D, None)),
    ("direct get flights (query)", lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FLIGHTS}",
                                                        body(last_by_subj=f"$KV.{wire.FLIGHTS_BUCKET}.{s.flight}")),
     (D, D, D, NO_DIRECT)),
    ("direct get finals (query)", lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FINALS}",
                                                       body(last_by_subj=f"$KV.{wire.FINALS_BUCKET}.{s.flight}")),
     (D, D, D, NO_DIRECT)),
    *((f"direct get {which} (query: walk the stream)",
       lambda s, r, me, decode=decode: Pub(f"$JS.API.DIRECT.GET.{claims_in(decode(s, me))}",
                                           body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
       (D, D, D, as_scheduler(tried, ALLOWED))) for which, decode, tried in CLAIM_STREAMS),
    ("direct get the flight (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FLIGHTS}.$KV.{wire.FLIGHTS_BUCKET}.{s.flight}"), (D, D, D, NO_DIRECT)),
    ("direct get the final (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FINALS}.$KV.{wire.FINALS_BUCKET}.{s.flight}"), (D, D, D, NO_DIRECT)),
    ("direct get its own claim on the fenced attempt's key (subject)",
     lambda s, r, me: own_direct_get(s, r, me, s.fenced), (D, D, NOT_FOUND, NOT_FOUND)),
    ("direct get its own claim, with a query body",
     lambda s, r, me: own_direct_get(s, r, me, s.fenced, body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
     (D, D, status(408), status(408))),
    ("direct get its own claims on every attempt (subject *)",
     lambda s, r, me: own_direct_get(s, r, me, "*"), (D, D, NOT_FOUND, NOT_FOUND)),
    ("direct get every claimant's claims in its own stream (subject *.decode.*)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{claims_in(me)}.{wire.CLAIMS_SUBJECT_PREFIX}.{me}.*.decode.*"),
     (D, D, D, None)),
    ("direct get the victim decode's claim (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}."
                          f"{wire.Claimant.decode(s.decode).subject(s.decode, s.decoded)}"),
     (D, D, D, ALLOWED)),
    ("direct get another decode's stream, at the subject of its own claim there",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}.{own(r, me).subject(s.decode, s.decoded)}"),
     (D, D, D, None)),
    ("direct get another decode's stream, at the subjects of its own stream",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}.{own(r, me).subject(me, '*')}"), (D, D, D, None)),
    ("direct get the schedulers' stream, at the subjects of its own claims there",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{SCHEDULERS_CLAIMS}.{own(r, me).subject('', '*')}"),
     (D, D, D, NOT_FOUND)),
    ("direct get the fence (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}.{fence_of(s).subject(s.decode, s.fenced)}"),
     (D, D, D, ALLOWED)),
    ("direct get the fence on an attempt with no decode (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{SCHEDULERS_CLAIMS}.{fence_of(s).subject('', s.pended)}"),
     (D, D, D, ALLOWED)),
    ("direct get every decode's claims in the victim decode's stream (subject *.decode.*)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}.{wire.CLAIMS_SUBJECT_PREFIX}.{s.decode}.*.decode.*"),
     (D, D, D, ALLOWED)),
    ("direct get any claim in the victim decode's stream (subject >)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{s.victims}.{wire.CLAIMS_SUBJECT_PREFIX}.>"), (D, D, D, ALLOWED)),
    *((f"consumer create {which}",
       lambda s, r, me, where=where: Pub(f"$JS.API.CONSUMER.CREATE.{where(s, me)}", consumer(where(s, me))),
       (D, D, D, as_scheduler(tried, ALLOWED))) for which, where, tried in STREAMS),
    ("consumer create the victim decode's claims, named and filtered",
     lambda s, r, me: Pub(f"$JS.API.CONSUMER.CREATE.{s.victims}.spy.{wire.CLAIMS_SUBJECT_PREFIX}.>",
                          consumer(s.victims, name="spy", filter_subject=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
     (D, D, D, ALLOWED)),
    ("stream create", lambda s, r, me: Pub("$JS.API.STREAM.CREATE.kvpush_hostile", body(
        name="kvpush_hostile", subjects=["kvpush.hostile.>"], storage="file", max_bytes=1 << 20)), (D, D, D, ALLOWED)),
    ("stream create: a claims stream for itself",
     lambda s, r, me: Pub(f"$JS.API.STREAM.CREATE.{claims_in(me + '-2')}", opened_claims_settings(me + "-2")),
     (D, D, D, None)),
    *((f"stream update {which} (let rollups, purges, deletes in)",
       lambda s, r, me, decode=decode: Pub(f"$JS.API.STREAM.UPDATE.{claims_in(decode(s, me))}",
                                           opened_claims_settings(decode(s, me))),
       (D, D, D, None)) for which, decode, tried in CLAIM_STREAMS),
    ("purge flights", lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}"), (D, D, D, None)),
    ("purge finals", lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FINALS}"), (D, D, D, None)),
    *((f"purge {which}", lambda s, r, me, decode=decode: Pub(f"$JS.API.STREAM.PURGE.{claims_in(decode(s, me))}"),
       (D, D, D, as_scheduler(tried, refused(PURGE_NOT_PERMITTED)))) for which, decode, tried in CLAIM_STREAMS),
    ("purge flights of a key nobody uses",
     lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}", body(filter=f"$KV.{wire.FLIGHTS_BUCKET}.o.{me}.none")),
     (D, D, D, ALLOWED)),
    *((f"delete stream {which}", lambda s, r, me, where=where: Pub(f"$JS.API.STREAM.DELETE.{where(s, me)}"),
       (D, D, D, None)) for which, where, tried in STREAMS),
    ("delete a stream that is not there", lambda s, r, me: Pub("$JS.API.STREAM.DELETE.kvpush_none"),
     (D, D, D, refused(STREAM_NOT_FOUND))),
    ("delete the flight's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{FLIGHTS}", body(seq=s.flight_revision)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the final's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{FINALS}", body(seq=s.final_revision)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the fence's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{s.victims}", body(seq=s.fence.sequence)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the victim decode's claim's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{s.victims}", body(seq=s.held.sequence)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the message of the fence on an attempt with no decode",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{SCHEDULERS_CLAIMS}", body(seq=s.pending.sequence)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete a message of its own claims",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{claims_in(me)}", body(seq=1)), (D, D, D, None)),
    ("put over the flight", lambda s, r, me: Pub(f"$KV.{wire.FLIGHTS_BUCKET}.{s.flight}", b"forged"), (D, D, D, None)),
    ("put a flight of its own", lambda s, r, me: Pub(f"$KV.{wire.FLIGHTS_BUCKET}.o.{me}.mine", b"mine"),
     (D, D, D, ALLOWED)),
    ("put a flight with Nats-Rollup: all",
     lambda s, r, me: Pub(f"$KV.{wire.FLIGHTS_BUCKET}.o.{me}.wipe", b"", {"Nats-Rollup": "all"}), (D, D, D, None)),
    ("put over the final", lambda s, r, me: Pub(f"$KV.{wire.FINALS_BUCKET}.{s.flight}", b"forged"), (D, D, D, None)),
    ("put a final of its own", lambda s, r, me: Pub(f"$KV.{wire.FINALS_BUCKET}.o.{me}.mine", b"mine"),
     (D, D, D, ALLOWED)),
    ("put a final with Nats-Rollup: all",
     lambda s, r, me: Pub(f"$KV.{wire.FINALS_BUCKET}.o.{me}.wipe", b"", {"Nats-Rollup": "all"}), (D, D, D, None)),
    ("put an 8 MiB final", lambda s, r, me: Pub(f"$KV.{wire.FINALS_BUCKET}.o.{me}.big", b"x" * EIGHT_MIB),
     (D, D, D, None)),
    ("claim as itself", lambda s, r, me: claim_of_own(s, r, me, fresh()), (D, D, ALLOWED, ALLOWED)),
    ("claim as itself in the victim decode's stream",
     lambda s, r, me: Pub(own(r, me).subject(s.decode, key := fresh()), b"", claiming(s.decode, key)),
     (D, D, D, ALLOWED)),
    ("claim as itself in the schedulers' stream (an attempt with no decode)",
     lambda s, r, me: Pub(own(r, me).subject("", key := fresh()), b"", claiming("", key)), (D, D, D, ALLOWED)),
    ("claim as itself in every decode's stream at once (decode token *)",
     lambda s, r, me: Pub(f"{wire.CLAIMS_SUBJECT_PREFIX}.*.{fresh()}.{own(r, me).token}"), (D, D, D, None)),
    ("claim the fenced attempt as itself",
     lambda s, r, me: Pub(own(r, me).subject(s.decode, s.fenced), b"", claiming(s.decode, s.fenced)),
     (D, D, D, refused(WRONG_LAST_SEQUENCE))),
    ("claim the fenced attempt's key in its own stream (another attempt: the fence holds)",
     lambda s, r, me: Pub(own(r, me).subject(me, s.fenced), b"", claiming(me, s.fenced)), (D, D, ALLOWED, None)),
    ("claim the attempt with no decode as itself",
     lambda s, r, me: Pub(own(r, me).subject("", s.pended), b"", claiming("", s.pended)),
     (D, D, D, refused(WRONG_LAST_SEQUENCE))),
    ("claim the victim decode's attempt as itself",
     lambda s, r, me: Pub(own(r, me).subject(s.decode, s.decoded), b"", claiming(s.decode, s.decoded)),
     (D, D, D, refused(WRONG_LAST_SEQUENCE))),
    ("claim as the victim decode",
     lambda s, r, me: Pub(wire.Claimant.decode(s.decode).subject(s.decode, key := fresh()), b"",
                          claiming(s.decode, key)), (D, D, D, D)),
    ("claim the fenced attempt as its scheduler",
     lambda s, r, me: Pub(fence_of(s).subject(s.decode, s.fenced), b"", claiming(s.decode, s.fenced)),
     (D, D, D, D)),
    ("claim the attempt with no decode as its scheduler",
     lambda s, r, me: Pub(fence_of(s).subject("", s.pended), b"", claiming("", s.pended)), (D, D, D, D)),
    ("claim with Nats-Rollup: all", lambda s, r, me: claim_of_own(s, r, me, fresh(), **{"Nats-Rollup": "all"}),
     (D, D, refused(ROLLUP_NOT_PERMITTED), refused(ROLLUP_NOT_PERMITTED))),
    ("claim with Nats-Rollup: sub", lambda s, r, me: claim_of_own(s, r, me, fresh(), **{"Nats-Rollup": "sub"}),
     (D, D, refused(ROLLUP_NOT_PERMITTED), refused(ROLLUP_NOT_PERMITTED))),
    ("claim on the fenced attempt with Nats-Rollup: sub",
     lambda s, r, me: Pub(own(r, me).subject(s.decode, s.fenced), b"", {"Nats-Rollup": "sub"}),
     (D, D, D, refused(ROLLUP_NOT_PERMITTED))),
    ("claim one byte over the cap",
     lambda s, r, me: claim_of_own(s, r, me, fresh(), b"x" * (wire.CLAIM_MAX_MSG_BYTES + 1)),
     (D, D, refused(MESSAGE_TOO_LARGE), refused(MESSAGE_TOO_LARGE))),
    ("claim of 8 MiB", lambda s, r, me: claim_of_own(s, r, me, fresh(), b"x" * EIGHT_MIB),
     (D, D, refused(MESSAGE_TOO_LARGE), refused(MESSAGE_TOO_LARGE))),
    ("claim with Nats-TTL", lambda s, r, me: claim_of_own(s, r, me, fresh(), **{"Nats-TTL": "1s"}),
     (D, D, refused(TTL_DISABLED), refused(TTL_DISABLED))),
    ("claim on a wildcard subject (*) of its own",
     lambda s, r, me: Pub(own(r, me).subject(home(s, r, me), "*")), (D, D, ALLOWED, ALLOWED)),
    ("subscribe $KV.>", lambda s, r, me: Sub("$KV.>"), (D, D, D, D)),
    ("subscribe the flights", lambda s, r, me: Sub(f"$KV.{wire.FLIGHTS_BUCKET}.>"), (D, D, D, D)),
    ("subscribe kvpush.claims.>", lambda s, r, me: Sub(f"{wire.CLAIMS_SUBJECT_PREFIX}.>"), (D, D, D, D)),
    ("subscribe its own claims", lambda s, r, me: Sub(wire.claims_scope(me)), (D, D, D, None)),
    ("subscribe $JS.API.> (answer as JetStream)", lambda s, r, me: Sub("$JS.API.>"), (D, D, D, D)),
    ("subscribe $JS.EVENT.>", lambda s, r, me: Sub("$JS.EVENT.>"), (D, D, D, D)),
]
ROLES = ("client", "prefill", "decode", "scheduler")
ROWS = [pytest.param(role, make, verdicts[column], id=f"{role}: {what}")
        for what, make, verdicts in TABLE for column, role in enumerate(ROLES) if verdicts[column] is not None]


@pytest.fixture(scope="module")
def server():
    with NatsUnderTest("deployed") as server:
        yield server


@pytest.fixture(scope="module")
async def scene(server):
    scene = await stage(server)
    yield scene
    await close(scene)


@pytest.mark.parametrize("role,make,expected", ROWS)
async def test_each_identity_gets_the_servers_verdict_and_wrecks_nothing(scene, role, make, expected):
    who = await (hostile_decode(scene) if role == "decode" else hostile(scene.server, role))
    try:
        got = await answer(who, make(scene, role, who.name))
    finally:
        await who.nc.close()
    assert got == expected, who.errors
    assert await damage(scene) == {}


# ------------------------------------------------------------------ the old design's attacks


async def test_a_a_rollup_on_a_claim_of_its_own_wipes_no_fence(scene):
    """Old: one ``Nats-Rollup: all`` on a claim key of its own deleted every claim. Now a
    decode's rollup could reach only its own stream, and that refuses rollups."""
    attacker = await hostile_decode(scene)
    try:
        mine = wire.Claimant.decode(attacker.name)
        for rollup in ("all", "sub"):
            key = fresh()
            assert await answer(attacker, Pub(mine.subject(attacker.name, key), b"",
                                              claiming(attacker.name, key, **{"Nats-Rollup": rollup}))) \
                == refused(ROLLUP_NOT_PERMITTED)
    finally:
        await attacker.nc.close()
    assert await damage(scene) == {}
    # the decode the fence is against still finds it
    late = await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(scene.fenced_transfer)
    assert late.state is ClaimState.LOST


async def test_b_an_oversized_claim_is_refused_and_takes_no_room(scene):
    """Old: an 8 MiB claim was accepted; about 32 filled the bucket."""
    js = scene.observer.jetstream()
    attacker = await hostile_decode(scene)
    stream = wire.claims_stream(attacker.name)
    try:
        held_before = (await js.stream_info(stream)).state.bytes
        mine = wire.Claimant.decode(attacker.name)
        for size in (wire.CLAIM_MAX_MSG_BYTES + 1, EIGHT_MIB):
            key = fresh()
            oversized = Pub(mine.subject(attacker.name, key), b"x" * size, claiming(attacker.name, key))
            assert await answer(attacker, oversized) == refused(MESSAGE_TOO_LARGE)
        held_after = (await js.stream_info(stream)).state.bytes
        claim = await Claims(attacker.nc, mine).claim("after-oversized-" + os.urandom(8).hex())
    finally:
        await attacker.nc.close()
    assert held_after == held_before
    assert claim.won  # a claim of its proper size still lands


class Impersonating(Claims):
    """``Claims`` under another's name, on a stream that is there (it makes none)."""

    async def ensure_stream(self, decode_id: str) -> None:
        pass


async def test_c_a_decode_claims_only_under_its_own_name(scene):
    """A ``Claims`` that names another claimant is refused by the server: never WON, and the
    attempt is left for its real claimant."""
    attacker = await hostile_decode(scene)
    try:
        for victim in (wire.Claimant.decode(scene.decode), fence_of(scene)):
            transfer = "impersonated-" + os.urandom(8).hex()
            claim = await Impersonating(attacker.nc, victim, timeout_s=0.5, within_s=0.5).claim(
                transfer, scene.decode)
            assert claim.state is ClaimState.UNKNOWN
            assert attacker.violated("publish", victim.subject(scene.decode, wire.claim_key(transfer))), \
                attacker.errors
            real = await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(transfer)
            assert real.won and real.holder == wire.Claimant.decode(scene.decode)
    finally:
        await attacker.nc.close()
    assert await damage(scene) == {}


async def test_d_a_fenced_decode_learns_at_once_that_it_lost(scene):
    """Old: the decode could not read the fence, timed out (5 s) and answered anyway."""
    decode = await hostile(scene.server, "decode")
    transfer = "fenced-" + os.urandom(8).hex()
    assert (await scene.ledger.claim(transfer, decode.name)).won  # makes its stream, and fences it there
    try:
        start = time.monotonic()
        claim = await Claims(decode.nc, wire.Claimant.decode(decode.name)).claim(transfer)
        took = time.monotonic() - start
    finally:
        await decode.nc.close()
    assert claim.state is ClaimState.LOST
    assert took < 1.0, f"{took:.2f}s: it waited for something"
    assert decode.errors == []


async def test_d_a_decode_whose_ack_was_lost_learns_it_won(scene):
    """It claimed, the ack never came back, it claims again: its own claim message, found by
    its direct get, says it won; a scheduler then loses to it."""
    transfer = "ack-lost-" + os.urandom(8).hex()
    key = wire.claim_key(transfer)
    decode = await hostile_decode(scene)
    me = wire.Claimant.decode(decode.name)
    try:
        await decode.nc.publish(me.subject(decode.name, key), b"", headers=claiming(decode.name, key))  # no ack
        await decode.nc.flush()
        first = await stored(scene, decode.name, key)
        again = await Claims(decode.nc, me).claim(transfer)
        twice = await Claims(decode.nc, me).claim(transfer)
    finally:
        await decode.nc.close()
    assert first.holder == me
    assert (again.state, again.holder, again.sequence) == (ClaimState.WON, me, first.sequence)
    assert (twice.state, twice.sequence) == (ClaimState.WON, first.sequence)
    late = await scene.ledger.claim(transfer, decode.name)
    assert (late.state, late.holder) == (ClaimState.LOST, me)


async def stored(scene: Scene, decode_id: str, key: str) -> Claim:
    """The claim on ``key`` in ``decode_id``'s stream as the observer reads it, once JetStream
    has stored one (a publish with no reply is stored a moment after the server takes it)."""
    reader = Claims(scene.observer, wire.Claimant.scheduler(scene.server.observer(), "observer"))
    for _ in range(100):
        claim = await reader.holder(decode_id, key)
        if claim.holder is not None:
            return claim
        await asyncio.sleep(0.02)
    return claim


async def test_claims_on_wildcard_subjects_of_its_own_fence_nobody(scene):
    """The server stores a publish on ``kvpush.claims.<me>.*.decode.<me>`` or ``...>...`` as
    it is; no attempt's claim filter matches it, so every later claim is decided as before,
    the attacker's own attempts' too."""
    attacker = await hostile_decode(scene)
    mine = wire.Claimant.decode(attacker.name)
    try:
        for token in ("*", ">"):
            assert await answer(attacker, Pub(mine.subject(attacker.name, token))) == ALLOWED
        assert (await Claims(attacker.nc, mine).claim("after-wildcards-" + os.urandom(8).hex())).won
    finally:
        await attacker.nc.close()
    assert (await scene.ledger.claim("after-wildcards-" + os.urandom(8).hex(), attacker.name)).won
    assert (await scene.ledger.claim("after-wildcards-" + os.urandom(8).hex(), scene.decode)).won
    assert (await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(
        "after-wildcards-" + os.urandom(8).hex())).won
    assert await damage(scene) == {}


# ------------------------------------------------------------------ ways around the table

# Each on a server of its own: if the attack worked it would wreck what it attacks.
BOUNCED: list[tuple[str, Callable[[Scene], Pub]]] = [
    ("stream info flights", lambda s: Pub(f"$JS.API.STREAM.INFO.{FLIGHTS}")),
    ("direct get the victim decode's claims (query: walk the stream)",
     lambda s: Pub(f"$JS.API.DIRECT.GET.{s.victims}", body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>"))),
    ("purge flights", lambda s: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}")),
    ("put a final with Nats-Rollup: all",
     lambda s: Pub(f"$KV.{wire.FINALS_BUCKET}.o.x.wipe", b"", {"Nats-Rollup": "all"})),
    ("delete stream the victim decode's claims", lambda s: Pub(f"$JS.API.STREAM.DELETE.{s.victims}")),
    ("delete stream the schedulers' claims", lambda s: Pub(f"$JS.API.STREAM.DELETE.{SCHEDULERS_CLAIMS}")),
    ("claim as the victim decode",
     lambda s: Pub(wire.Claimant.decode(s.decode).subject(s.decode, key := fresh()), b"", claiming(s.decode, key))),
]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("what,make", BOUNCED, ids=[what for what, _ in BOUNCED])
async def test_a_reply_subject_bounced_off_its_own_subscription_opens_nothing(role, what, make):
    """Workers once had ``allow_responses``: a worker could publish once on the reply subject
    of any message it received. It receives its own agent announcements (it publishes
    ``kvpush.kv.agents.<me>`` and subscribes to ``kvpush.kv.agents.*``), so it announced with
    the reply subject it wanted to publish on, heard itself, and "answered" (a publish
    ``deny`` list does not stop a response). Workers now answer only on ``_KVPUSH_INBOX.>``:
    it still hears itself, and the server denies the answer."""
    with NatsUnderTest("deployed") as server:
        scene = await stage(server)
        who = await hostile(server, role)
        try:
            attempt = make(scene)
            echoed = asyncio.get_running_loop().create_future()
            await who.nc.subscribe(wire.KV_AGENTS.wildcard, cb=settling(echoed))
            await who.nc.flush()
            await who.nc.publish(wire.KV_AGENTS(sender=who.name), b"agent", reply=attempt.subject)
            await asyncio.wait({echoed}, timeout=2.0)
            got = await answer(who, attempt)
            damaged = await damage(scene)
        finally:
            await who.nc.close()
            await close(scene)
    assert echoed.done() and echoed.result().reply == attempt.subject  # the bait came back to it
    assert (got, sorted(damaged)) == (DENIED, []), damaged


async def test_a_decode_answering_an_accomplices_agent_request_opens_nothing():
    """The same with two identities: a prefill asks a decode's agent with the reply subject
    the decode wants to publish on; the server denies the decode's answer."""
    with NatsUnderTest("deployed") as server:
        scene = await stage(server)
        decode, prefill = await hostile(server, "decode"), await hostile(server, "prefill")
        attempt = Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}")
        try:
            asked = asyncio.get_running_loop().create_future()
            await decode.nc.subscribe(wire.KV_AGENT.partly(engine_id=decode.name), cb=settling(asked))
            await decode.nc.flush()
            for _ in range(40):  # the decode's flush is no barrier for its SUB at the prefill: ask until it lands
                await prefill.nc.publish(wire.KV_AGENT(engine_id=decode.name, rank=0), b"", reply=attempt.subject)
                await prefill.nc.flush()
                await asyncio.wait({asked}, timeout=0.05)
                if asked.done():
                    break
            got = await answer(decode, attempt)
            damaged = await damage(scene)
        finally:
            await decode.nc.close()
            await prefill.nc.close()
            await close(scene)
    assert asked.done() and asked.result().reply == attempt.subject  # the accomplice's request reached it
    assert (got, sorted(damaged)) == (DENIED, []), damaged


FLOOD_PAYLOAD = wire.CLAIM_MAX_MSG_BYTES - 64  # a claim's value, well under the cap with its headers
FLOOD_MAX = wire.CLAIMS_MAX_BYTES // FLOOD_PAYLOAD  # at most the stream's limit in values (~37,000 claims)
FLOOD_BATCH = 2000


async def test_a_decode_that_floods_its_own_claims_stream_fills_only_that():
    """Every claim is under 512 B, but a decode may claim any key under its own name. In
    the one stream of old, a decode filled its bytes in about a second and every claim was
    refused after (UNKNOWN: nobody answered). Now it can fill only its own stream: a
    scheduler's claim on another decode's attempt and on one with no decode, and that other
    decode's own claim, all still win; and it cannot publish a claim into any other stream."""
    with NatsUnderTest("deployed") as server:
        scene = await stage(server)
        attacker = await hostile_decode(scene)
        mine = wire.Claimant.decode(attacker.name)
        js = scene.observer.jetstream(timeout=ANSWER_S)
        flooded = wire.claims_stream(attacker.name)
        others = (scene.victims, SCHEDULERS_CLAIMS)
        try:
            others_before = {name: (await js.stream_info(name)).state for name in others}
            filler, sent, start = b"x" * FLOOD_PAYLOAD, 0, time.monotonic()
            full = lambda info: info.state.bytes > wire.CLAIMS_MAX_BYTES - 4096  # noqa: E731
            while sent < FLOOD_MAX:
                batch = min(FLOOD_BATCH, FLOOD_MAX - sent)
                for _ in range(batch):
                    await attacker.nc.publish(mine.subject(attacker.name, fresh()), filler)
                sent += batch
                await attacker.nc.flush()
                if full(await js.stream_info(flooded)):
                    break
            for _ in range(100):  # JetStream stores a moment after the server takes a publish
                info = await js.stream_info(flooded)
                if full(info):
                    break
                await asyncio.sleep(0.05)
            took = time.monotonic() - start
            # The last few hundred bytes: empty claims, each acknowledged, until the stream refuses one.
            topped, last = 0, {}
            while topped < 64 and "error" not in last:
                ack = await attacker.nc.request(mine.subject(attacker.name, fresh()), b"", timeout=ANSWER_S)
                last = json.loads(ack.data)
                topped += 1
            info = await js.stream_info(flooded)
            print(f"\nflood: {sent} claims sent in {took:.2f}s, {topped} more to the brim; {info.state.messages} "
                  f"stored, {info.state.bytes} B of {wire.CLAIMS_MAX_BYTES}; refused: {last.get('error')}")
            others_after = {name: (await js.stream_info(name)).state for name in others}
            # It is full: its own next claim is refused (its own attempts, and only they, go unanswered).
            own_after = await Claims(attacker.nc, mine).claim("after-flood-own-" + os.urandom(8).hex())
            # It cannot spill into another decode's stream, nor into the schedulers'.
            into_victims = await answer(attacker, Pub(mine.subject(scene.decode, key := fresh()), b"",
                                                      claiming(scene.decode, key)))
            into_schedulers = await answer(attacker, Pub(mine.subject("", key := fresh()), b"", claiming("", key)))
            by_scheduler = await scene.ledger.claim("after-flood-" + os.urandom(8).hex(), scene.decode)
            pending = await scene.ledger.claim("after-flood-" + os.urandom(8).hex(), "")
            by_decode = await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(
                "after-flood-" + os.urandom(8).hex())
            damaged = await damage(scene)
        finally:
            await attacker.nc.close()
            await close(scene)
    assert full(info), f"{sent} claims left {info.state.bytes} B of {wire.CLAIMS_MAX_BYTES}"
    assert "error" in last, f"{topped} empty claims after the flood all landed: the stream was not full"
    assert {name: (state.messages, state.bytes) for name, state in others_after.items()} == \
        {name: (state.messages, state.bytes) for name, state in others_before.items()}
    assert own_after.state is ClaimState.UNKNOWN
    assert (into_victims, into_schedulers) == (DENIED, DENIED), attacker.errors
    assert (by_scheduler.state, pending.state, by_decode.state) == (ClaimState.WON,) * 3
    assert damaged == {}
