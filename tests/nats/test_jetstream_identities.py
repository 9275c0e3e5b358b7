"""Hostile identities against JetStream (issue 24): a client, a prefill and a decode try every
``$JS.API``/``$KV`` path and every claim trick on the server ``kvpush nats-config`` generates,
and each attempt must end as the table says, *by the server's word*: a permissions violation
it reports (``denied``), a JetStream error it answers (``refused <err_code>``), or the answer
itself (``allowed``, ``not found``, ``status <code>``). A scheduler runs the same table as the
control: it may use the JetStream API, and the streams' own settings are all that stops it.

After every attempt the things attacked (a scheduler's flight, its stored final, its fence
on one attempt, a decode's claim on another, and the three streams' settings) are read back
as the observer and must be as they were. The attacks the old design fell to (a KV bucket of
claims that decodes wrote through ``$KV.kvpush_claims.*``) are tests of their own, on the
real ``Claims``: (a) a rollup, (b) an oversized claim, (c) a claim under another's name,
(d) a fenced decode, and a decode whose ack was lost.

Two more ways in have tests of their own, each on a server of its own (they wreck the state
they attack when they work): a reply subject bounced off the attacker's own subscription
(``allow_responses``), and a decode that fills the claims stream with claims of its own."""

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

from services.ledger import WRONG_LAST_SEQUENCE, Claim, ClaimState, Claims, Ledger
from shared import wire
from tests.nats.deployed import NatsUnderTest

FLIGHTS = f"KV_{wire.FLIGHTS_BUCKET}"
FINALS = f"KV_{wire.FINALS_BUCKET}"
CLAIMS = wire.CLAIMS_STREAM
STREAMS = (FLIGHTS, FINALS, CLAIMS)
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
    fenced_transfer: str  # the victim scheduler holds this attempt's claim (a fence)
    decoded_transfer: str  # the victim decode holds this one's
    flight: str = ""
    fence: Claim | None = None
    held: Claim | None = None
    flight_revision: int = 0
    final_revision: int = 0
    before: dict = field(default_factory=dict)

    @property
    def fenced(self) -> str:
        return wire.claim_key(self.fenced_transfer)

    @property
    def decoded(self) -> str:
        return wire.claim_key(self.decoded_transfer)


async def stage(server: NatsUnderTest) -> Scene:
    """A scheduler makes the buckets and the claims stream and writes a flight, a final and a
    fence; a decode claims another attempt."""
    scheduler, decode = server.identity("scheduler"), server.identity("decode")
    scheduler_nc = await server.connect(scheduler)
    ledger = await Ledger.open(scheduler_nc, me=wire.Claimant.scheduler(scheduler, "inc"))
    scene = Scene(server, await server.connect(server.observer()), ledger, scheduler, decode,
                  await server.connect(decode), "fenced-" + os.urandom(8).hex(), "decoded-" + os.urandom(8).hex())
    now = time.time()
    flight = wire.FlightRecord(
        request_id=REQUEST_ID, owner=OWNER, reply_to=f"{wire.CLIENT_INBOX_PREFIX}.{OWNER}.r", received_at=now,
        deadline_at=now + 300, prompt_token_ids=[1, 2, 3], sampling=wire.SamplingSpec(4, 0.0, False),
        transfer_mode=None, holder=scheduler, holder_incarnation="inc", transfer_key=scene.fenced_transfer)
    scene.flight = wire.flight_key(OWNER, REQUEST_ID)
    scene.flight_revision = await ledger.record(flight)
    await ledger.keep_final(OWNER, REQUEST_ID, b'{"request_id": "request-1", "text": "the answer"}')
    scene.fence = await ledger.claim(scene.fenced_transfer)
    scene.held = await Claims(scene.decode_nc, wire.Claimant.decode(decode)).claim(scene.decoded_transfer)
    assert scene.flight_revision and scene.fence.won and scene.held.won
    scene.before = await snapshot(scene)
    assert scene.before["final"] is not None
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
    for name in STREAMS:
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
    claims = {"fence": None, "held": None}
    if settings[CLAIMS] is not None:  # with no stream, a read would wait out an election
        reader = Claims(scene.observer, wire.Claimant.scheduler(scene.server.observer(), "observer"))
        claims = {"fence": await reader.holder(scene.fenced), "held": await reader.holder(scene.decoded)}
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


def claiming(key: str, **more: str) -> dict:
    """A claim's headers (as ``Claims`` sends them): the first message over the attempt's."""
    return {"Nats-Expected-Last-Subject-Sequence": "0",
            "Nats-Expected-Last-Subject-Sequence-Subject": wire.claims_of(key), **more}


def fence_of(scene: Scene) -> wire.Claimant:
    return wire.Claimant.scheduler(scene.scheduler, "inc")


def own(role: str, me: str) -> wire.Claimant:
    """Who ``me`` claims as: a scheduler as itself; anyone else as a decode of its name."""
    return wire.Claimant.scheduler(me, "inc") if role == "scheduler" else wire.Claimant.decode(me)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def consumer(stream: str, **config) -> bytes:
    return body(stream_name=stream, config={"ack_policy": "none", "inactive_threshold": 1_000_000_000, **config})


def claim_of_own(role, me, key, payload=b"", **headers) -> Pub:
    return Pub(own(role, me).subject(key), payload, claiming(key, **headers))


def opened_claims_settings() -> bytes:
    """The claims stream's settings with rollups, purges and deletes let through."""
    config = Claims.stream_config(1, 660).as_dict()
    return json.dumps({**config, "allow_rollup_hdrs": True, "deny_purge": False, "deny_delete": False}).encode()


NO_DIRECT = status(503)  # the buckets are made without direct gets: nobody answers one
Attempt = Callable[[Scene, str, str], Pub | Sub]  # (scene, role, my name)
D = DENIED
# (what is tried, the attempt, the verdict for a client, a prefill, a decode, a scheduler);
# None: not tried (a scheduler may wreck what it is trusted with)
TABLE: list[tuple[str, Attempt, tuple]] = [
    ("api info", lambda s, r, me: Pub("$JS.API.INFO"), (D, D, D, ALLOWED)),
    ("stream names", lambda s, r, me: Pub("$JS.API.STREAM.NAMES"), (D, D, D, ALLOWED)),
    *((f"stream info {stream}", lambda s, r, me, stream=stream: Pub(f"$JS.API.STREAM.INFO.{stream}"),
       (D, D, D, ALLOWED)) for stream in STREAMS),
    ("msg get flights", lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{FLIGHTS}",
                                             body(last_by_subj=f"$KV.{wire.FLIGHTS_BUCKET}.{s.flight}")),
     (D, D, D, ALLOWED)),
    ("msg get finals", lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{FINALS}",
                                            body(last_by_subj=f"$KV.{wire.FINALS_BUCKET}.{s.flight}")),
     (D, D, D, ALLOWED)),
    ("msg get claims",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.GET.{CLAIMS}", body(last_by_subj=wire.claims_of(s.fenced))),
     (D, D, D, ALLOWED)),
    ("direct get flights (query)", lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FLIGHTS}",
                                                        body(last_by_subj=f"$KV.{wire.FLIGHTS_BUCKET}.{s.flight}")),
     (D, D, D, NO_DIRECT)),
    ("direct get finals (query)", lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FINALS}",
                                                       body(last_by_subj=f"$KV.{wire.FINALS_BUCKET}.{s.flight}")),
     (D, D, D, NO_DIRECT)),
    ("direct get claims (query: walk the stream)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}", body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
     (D, D, D, ALLOWED)),
    ("direct get the flight (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FLIGHTS}.$KV.{wire.FLIGHTS_BUCKET}.{s.flight}"), (D, D, D, NO_DIRECT)),
    ("direct get the final (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{FINALS}.$KV.{wire.FINALS_BUCKET}.{s.flight}"), (D, D, D, NO_DIRECT)),
    ("direct get its own claim on the fenced attempt (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{own(r, me).subject(s.fenced)}"), (D, D, NOT_FOUND, NOT_FOUND)),
    ("direct get its own claim, with a query body",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{own(r, me).subject(s.fenced)}",
                          body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
     (D, D, status(408), status(408))),
    ("direct get its own claims on every attempt (subject *)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{own(r, me).subject('*')}"), (D, D, NOT_FOUND, NOT_FOUND)),
    ("direct get the victim decode's claim (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{wire.Claimant.decode(s.decode).subject(s.decoded)}"),
     (D, D, D, ALLOWED)),
    ("direct get the fence (subject)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{fence_of(s).subject(s.fenced)}"),
     (D, D, D, ALLOWED)),
    ("direct get every decode's claims (subject *.decode.*)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{wire.CLAIMS_SUBJECT_PREFIX}.*.decode.*"), (D, D, D, ALLOWED)),
    ("direct get any claim (subject >)",
     lambda s, r, me: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}.{wire.CLAIMS_SUBJECT_PREFIX}.>"), (D, D, D, ALLOWED)),
    *((f"consumer create {stream}",
       lambda s, r, me, stream=stream: Pub(f"$JS.API.CONSUMER.CREATE.{stream}", consumer(stream)),
       (D, D, D, ALLOWED)) for stream in STREAMS),
    ("consumer create claims, named and filtered",
     lambda s, r, me: Pub(f"$JS.API.CONSUMER.CREATE.{CLAIMS}.spy.{wire.CLAIMS_SUBJECT_PREFIX}.>",
                          consumer(CLAIMS, name="spy", filter_subject=f"{wire.CLAIMS_SUBJECT_PREFIX}.>")),
     (D, D, D, ALLOWED)),
    ("stream create", lambda s, r, me: Pub("$JS.API.STREAM.CREATE.kvpush_hostile", body(
        name="kvpush_hostile", subjects=["kvpush.hostile.>"], storage="file", max_bytes=1 << 20)), (D, D, D, ALLOWED)),
    ("stream update claims (let rollups, purges, deletes in)",
     lambda s, r, me: Pub(f"$JS.API.STREAM.UPDATE.{CLAIMS}", opened_claims_settings()), (D, D, D, None)),
    ("purge flights", lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}"), (D, D, D, None)),
    ("purge finals", lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FINALS}"), (D, D, D, None)),
    ("purge claims", lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{CLAIMS}"), (D, D, D, refused(PURGE_NOT_PERMITTED))),
    ("purge flights of a key nobody uses",
     lambda s, r, me: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}", body(filter=f"$KV.{wire.FLIGHTS_BUCKET}.o.{me}.none")),
     (D, D, D, ALLOWED)),
    *((f"delete stream {stream}", lambda s, r, me, stream=stream: Pub(f"$JS.API.STREAM.DELETE.{stream}"),
       (D, D, D, None)) for stream in STREAMS),
    ("delete a stream that is not there", lambda s, r, me: Pub("$JS.API.STREAM.DELETE.kvpush_none"),
     (D, D, D, refused(STREAM_NOT_FOUND))),
    ("delete the flight's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{FLIGHTS}", body(seq=s.flight_revision)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the final's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{FINALS}", body(seq=s.final_revision)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
    ("delete the fence's message",
     lambda s, r, me: Pub(f"$JS.API.STREAM.MSG.DELETE.{CLAIMS}", body(seq=s.fence.sequence)),
     (D, D, D, refused(DELETE_NOT_PERMITTED))),
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
    ("claim as itself", lambda s, r, me: claim_of_own(r, me, fresh()), (D, D, ALLOWED, ALLOWED)),
    ("claim the fenced attempt as itself", lambda s, r, me: claim_of_own(r, me, s.fenced),
     (D, D, refused(WRONG_LAST_SEQUENCE), refused(WRONG_LAST_SEQUENCE))),
    ("claim as the victim decode", lambda s, r, me: Pub(wire.Claimant.decode(s.decode).subject(key := fresh()), b"",
                                                         claiming(key)), (D, D, D, D)),
    ("claim the fenced attempt as its scheduler",
     lambda s, r, me: Pub(fence_of(s).subject(s.fenced), b"", claiming(s.fenced)),
     (D, D, D, D)),
    ("claim with Nats-Rollup: all", lambda s, r, me: claim_of_own(r, me, fresh(), **{"Nats-Rollup": "all"}),
     (D, D, refused(ROLLUP_NOT_PERMITTED), refused(ROLLUP_NOT_PERMITTED))),
    ("claim on the fenced attempt with Nats-Rollup: sub",
     lambda s, r, me: Pub(own(r, me).subject(s.fenced), b"", {"Nats-Rollup": "sub"}),
     (D, D, refused(ROLLUP_NOT_PERMITTED), refused(ROLLUP_NOT_PERMITTED))),
    ("claim one byte over the cap",
     lambda s, r, me: claim_of_own(r, me, fresh(), b"x" * (wire.CLAIM_MAX_MSG_BYTES + 1)),
     (D, D, refused(MESSAGE_TOO_LARGE), refused(MESSAGE_TOO_LARGE))),
    ("claim of 8 MiB", lambda s, r, me: claim_of_own(r, me, fresh(), b"x" * EIGHT_MIB),
     (D, D, refused(MESSAGE_TOO_LARGE), refused(MESSAGE_TOO_LARGE))),
    ("claim with Nats-TTL", lambda s, r, me: claim_of_own(r, me, fresh(), **{"Nats-TTL": "1s"}),
     (D, D, refused(TTL_DISABLED), refused(TTL_DISABLED))),
    ("claim on a wildcard subject (*) of its own", lambda s, r, me: Pub(own(r, me).subject("*")),
     (D, D, ALLOWED, ALLOWED)),
    ("subscribe $KV.>", lambda s, r, me: Sub("$KV.>"), (D, D, D, D)),
    ("subscribe the flights", lambda s, r, me: Sub(f"$KV.{wire.FLIGHTS_BUCKET}.>"), (D, D, D, D)),
    ("subscribe kvpush.claims.>", lambda s, r, me: Sub(f"{wire.CLAIMS_SUBJECT_PREFIX}.>"), (D, D, D, D)),
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
    who = await hostile(scene.server, role)
    try:
        got = await answer(who, make(scene, role, who.name))
    finally:
        await who.nc.close()
    assert got == expected, who.errors
    assert await damage(scene) == {}


# ------------------------------------------------------------------ the old design's attacks


async def test_a_a_rollup_on_a_claim_of_its_own_wipes_no_fence(scene):
    """Old: one ``Nats-Rollup: all`` on a claim key of its own deleted every claim."""
    attacker = await hostile(scene.server, "decode")
    fenced = await hostile(scene.server, "decode")  # the decode the fence is against
    try:
        mine = wire.Claimant.decode(attacker.name)
        for rollup in ("all", "sub"):
            key = fresh()
            assert await answer(attacker, Pub(mine.subject(key), b"", claiming(key, **{"Nats-Rollup": rollup}))) \
                == refused(ROLLUP_NOT_PERMITTED)
        assert await damage(scene) == {}
        late = await Claims(fenced.nc, wire.Claimant.decode(fenced.name)).claim(scene.fenced_transfer)
    finally:
        await attacker.nc.close()
        await fenced.nc.close()
    assert late.state is ClaimState.LOST


async def test_b_an_oversized_claim_is_refused_and_takes_no_room(scene):
    """Old: an 8 MiB claim was accepted; about 32 filled the bucket."""
    js = scene.observer.jetstream()
    attacker = await hostile(scene.server, "decode")
    try:
        held_before = (await js.stream_info(CLAIMS)).state.bytes
        mine = wire.Claimant.decode(attacker.name)
        for size in (wire.CLAIM_MAX_MSG_BYTES + 1, EIGHT_MIB):
            key = fresh()
            oversized = Pub(mine.subject(key), b"x" * size, claiming(key))
            assert await answer(attacker, oversized) == refused(MESSAGE_TOO_LARGE)
        held_after = (await js.stream_info(CLAIMS)).state.bytes
        claim = await Claims(attacker.nc, mine).claim("after-oversized-" + os.urandom(8).hex())
    finally:
        await attacker.nc.close()
    assert held_after == held_before
    assert claim.won  # a claim of its proper size still lands


async def test_c_a_decode_claims_only_under_its_own_name(scene):
    """A ``Claims`` that names another claimant is refused by the server: never WON, and the
    attempt is left for its real claimant."""
    attacker = await hostile(scene.server, "decode")
    try:
        for victim in (wire.Claimant.decode(scene.decode), fence_of(scene)):
            transfer = "impersonated-" + os.urandom(8).hex()
            claim = await Claims(attacker.nc, victim, timeout_s=0.5, within_s=0.5).claim(transfer)
            assert claim.state is ClaimState.UNKNOWN
            assert attacker.violated("publish", victim.subject(wire.claim_key(transfer))), attacker.errors
            real = await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(transfer)
            assert real.won and real.holder == wire.Claimant.decode(scene.decode)
    finally:
        await attacker.nc.close()
    assert await damage(scene) == {}


async def test_d_a_fenced_decode_learns_at_once_that_it_lost(scene):
    """Old: the decode could not read the fence, timed out (5 s) and answered anyway."""
    transfer = "fenced-" + os.urandom(8).hex()
    assert (await scene.ledger.claim(transfer)).won
    decode = await hostile(scene.server, "decode")
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
    decode = await hostile(scene.server, "decode")
    me = wire.Claimant.decode(decode.name)
    try:
        await decode.nc.publish(me.subject(key), b"", headers=claiming(key))  # the ack goes nowhere
        await decode.nc.flush()
        first = await stored(scene, key)
        again = await Claims(decode.nc, me).claim(transfer)
        twice = await Claims(decode.nc, me).claim(transfer)
    finally:
        await decode.nc.close()
    assert first.holder == me
    assert (again.state, again.holder, again.sequence) == (ClaimState.WON, me, first.sequence)
    assert (twice.state, twice.sequence) == (ClaimState.WON, first.sequence)
    late = await scene.ledger.claim(transfer)
    assert (late.state, late.holder) == (ClaimState.LOST, me)


async def stored(scene: Scene, key: str) -> Claim:
    """The claim on ``key`` as the observer reads it, once JetStream has stored one (a
    publish with no reply is stored a moment after the server takes it)."""
    reader = Claims(scene.observer, wire.Claimant.scheduler(scene.server.observer(), "observer"))
    for _ in range(100):
        claim = await reader.holder(key)
        if claim.holder is not None:
            return claim
        await asyncio.sleep(0.02)
    return claim


async def test_claims_on_wildcard_subjects_of_its_own_fence_nobody(scene):
    """The server stores a publish on ``kvpush.claims.*.decode.<me>`` or ``...>...`` as it is;
    no attempt's claim filter matches it, so every later claim is decided as before."""
    attacker = await hostile(scene.server, "decode")
    try:
        mine = wire.Claimant.decode(attacker.name)
        for token in ("*", ">"):
            assert await answer(attacker, Pub(mine.subject(token))) == ALLOWED
    finally:
        await attacker.nc.close()
    assert (await scene.ledger.claim("after-wildcards-" + os.urandom(8).hex())).won
    assert (await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(
        "after-wildcards-" + os.urandom(8).hex())).won
    assert await damage(scene) == {}


# ------------------------------------------------------------------ ways around the table

# Each on a server of its own: when the attack works it wrecks what it attacks.
BOUNCED: list[tuple[str, Callable[[Scene], Pub]]] = [
    ("stream info flights", lambda s: Pub(f"$JS.API.STREAM.INFO.{FLIGHTS}")),
    ("direct get claims (query: walk the stream)",
     lambda s: Pub(f"$JS.API.DIRECT.GET.{CLAIMS}", body(seq=1, next_by_subj=f"{wire.CLAIMS_SUBJECT_PREFIX}.>"))),
    ("purge flights", lambda s: Pub(f"$JS.API.STREAM.PURGE.{FLIGHTS}")),
    ("put a final with Nats-Rollup: all",
     lambda s: Pub(f"$KV.{wire.FINALS_BUCKET}.o.x.wipe", b"", {"Nats-Rollup": "all"})),
    ("delete stream claims", lambda s: Pub(f"$JS.API.STREAM.DELETE.{CLAIMS}")),
    ("claim as the victim decode",
     lambda s: Pub(wire.Claimant.decode(s.decode).subject(key := fresh()), b"", claiming(key))),
]


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("what,make", BOUNCED, ids=[what for what, _ in BOUNCED])
async def test_a_reply_subject_bounced_off_its_own_subscription_opens_nothing(role, what, make):
    """A service may answer the reply subject of any message it receives (``allow_responses``).
    It receives its own agent announcements (it publishes ``kvpush.kv.agents.<me>`` and
    subscribes to ``kvpush.kv.agents.*``), so it announces with the reply subject it wants to
    publish on, hears itself, and "answers". A publish ``deny`` list does not stop it
    (nats-server lets a response through a deny), so this fails while prefills and decodes
    have ``allow_responses``."""
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
    assert (got, sorted(damaged)) == (DENIED, []), damaged


async def test_a_decode_answering_an_accomplices_agent_request_opens_nothing():
    """The same with two identities: a prefill asks a decode's agent with the reply subject
    the decode wants to publish on."""
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
    assert (got, sorted(damaged)) == (DENIED, []), damaged


async def test_a_decode_cannot_fill_the_claims_stream_with_claims_of_its_own():
    """Every claim is under 512 B now, but a decode may claim any key under its own name:
    the stream's bytes (CLAIMS_MAX_BYTES, discard new) are everyone's, and once they are
    spent every claim is refused (UNKNOWN: nobody answers) until claims expire. It takes one
    decode about a second (~130,000 claims); this fails until that cannot happen."""
    with NatsUnderTest("deployed") as server:
        scene = await stage(server)
        attacker = await hostile(server, "decode")
        mine = wire.Claimant.decode(attacker.name)
        js = scene.observer.jetstream()
        try:
            for _ in range(2 * wire.CLAIMS_MAX_BYTES // wire.CLAIM_MAX_MSG_BYTES // 2000):
                for _ in range(2000):
                    await attacker.nc.publish(mine.subject(fresh()), b"x" * (wire.CLAIM_MAX_MSG_BYTES - 64))
                await attacker.nc.flush()
                if (await js.stream_info(CLAIMS)).state.bytes > wire.CLAIMS_MAX_BYTES - 4096:
                    break
            by_scheduler = await scene.ledger.claim("after-flood-" + os.urandom(8).hex())
            by_decode = await Claims(scene.decode_nc, wire.Claimant.decode(scene.decode)).claim(
                "after-flood-" + os.urandom(8).hex())
        finally:
            await attacker.nc.close()
            await close(scene)
    assert (by_scheduler.state, by_decode.state) == (ClaimState.WON, ClaimState.WON)
