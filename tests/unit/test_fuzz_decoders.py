"""Property-based fuzzing of every decoder kvpush runs on bytes from the network.

Each decoder either returns a value of the promised type or raises the one exception
class its callers catch, whatever the input: arbitrary bytes, arbitrary msgpack/JSON
values, and valid messages with bytes flipped. A crash of another class escapes the
caller's ``except`` and takes a subscription, a request's task or a thread down.
"""

from __future__ import annotations

import json
import math
import string
import typing
from types import SimpleNamespace

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

from kvpush.connector import kv_layout
from kvpush.connector.completion import Notification, block_tag, notification, parse_notification
from kvpush.connector.metadata import ReadyPrefill
from kvpush.connector.producer import sources
from kvpush.connector.transfer_book import pair_problem
from kvpush.services.scheduler.validation import MAX_REQUEST_ID_LEN, RequestValidator, ValidRequest, request_id_of
from kvpush.shared import wire
from kvpush.shared.errors import RequestError

FUZZ = settings(max_examples=250, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
PER_KIND = settings(FUZZ, max_examples=60)  # per message kind: 22 kinds, so ~1200 per property

STRUCTS = [
    wire.WorkerHeartbeat, wire.PrefillJob, wire.DecodeJob, wire.CancelJob, wire.RequestProgress, wire.TokensSent, wire.JobAck,
    wire.AgentInfo, wire.Registration, wire.LeaseRenewal, wire.Revoke, wire.Handoff, wire.TransferDone,
    wire.TransferFailed, wire.InvalidMessage, wire.SchedulerHeartbeat, wire.IntakeSettled, wire.FlightRecord, wire.StoredFinal,
    wire.MoveTransfer, wire.TransferMoved, wire.CacheEvents, wire.PromptReady, wire.LendJob, wire.Lent,
]
UNIONS = [wire.PrefillMessage, wire.DecodeMessage, wire.KvControl, wire.Completion]
KINDS = STRUCTS + UNIONS


def _name(kind) -> str:
    return getattr(kind, "__name__", None) or " | ".join(t.__name__ for t in typing.get_args(kind))


def _members(kind) -> tuple[type, ...]:
    return typing.get_args(kind) or (kind,)


# ------------------------------------------------------------------ strategies

MSGPACK_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
FINITE = st.floats(allow_nan=False)  # NaN != NaN would break round-trip equality
FIELD_NAMES = sorted({f.name for k in STRUCTS for f in mi.type_info(k).fields} | {"type"})
TAGS = [k.__name__ for k in STRUCTS]

SCALARS = st.none() | st.booleans() | MSGPACK_INT | st.floats() | st.text(max_size=20) | st.binary(max_size=20)


def _values(scalars):
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )


# Arbitrary msgpack values, and look-alikes of kvpush messages: real field names and tags.
ANY_VALUE = _values(SCALARS)
MESSAGE_LIKE = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=8),
    ANY_VALUE | st.sampled_from(TAGS) | st.sampled_from(["push", "pull", "prefill", "decode"]),
    max_size=12,
)
MSGPACK_OBJECTS = ANY_VALUE | MESSAGE_LIKE

JSON_SCALARS = st.none() | st.booleans() | st.integers() | FINITE | st.text(max_size=20)
JSON_VALUES = _values(JSON_SCALARS)
JSON_ANY = _values(st.none() | st.booleans() | MSGPACK_INT | FINITE | st.text(max_size=10))


def strategy_for(info: mi.Type) -> st.SearchStrategy:
    """Valid values of a field, from msgspec's own description of the type."""
    if isinstance(info, mi.StrType):
        return st.text(max_size=20)
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.IntType):  # within the type's bounds, if it has a lower one
        return MSGPACK_INT if info.ge is None else st.integers(min_value=info.ge, max_value=2**64 - 1)
    if isinstance(info, mi.FloatType):
        return FINITE
    if isinstance(info, mi.BytesType):  # within the type's length bounds, if it has any
        low = info.min_length or 0
        return st.binary(min_size=low, max_size=max(low, info.max_length if info.max_length is not None else 40))
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.ListType):
        return st.lists(strategy_for(info.item_type), max_size=min(6, info.max_length or 6))
    if isinstance(info, mi.DictType):
        return st.dictionaries(strategy_for(info.key_type), strategy_for(info.value_type), max_size=4)
    if isinstance(info, mi.UnionType):
        return st.one_of([strategy_for(t) for t in info.types])
    if isinstance(info, mi.AnyType):
        return JSON_ANY
    if isinstance(info, mi.StructType):
        return st.builds(info.cls, **{f.name: strategy_for(f.type) for f in info.fields})
    raise NotImplementedError(f"no strategy for {info!r}")  # a new field type: teach the fuzzer


def messages(kind) -> st.SearchStrategy:
    return strategy_for(mi.type_info(kind))


@st.composite
def mutated(draw, kind) -> bytes:
    """A valid encoded message with a few bytes flipped, inserted or cut."""
    data = bytearray(wire.encode(draw(messages(kind))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["flip", "insert", "cut"]))
        if edit == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif edit == "flip":
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        else:
            del data[at:at + draw(st.integers(1, 3))]
    return bytes(data)


def _decodes_or_refuses(data: bytes, kind) -> None:
    try:
        result = wire.decode(data, kind)
    except msgspec.MsgspecError:  # what every caller of wire.decode catches
        return
    assert isinstance(result, _members(kind))


# Invalid UTF-8 in a string field: msgspec raises UnicodeDecodeError (msgspec issue #714).
BAD_UTF8_TAG = b"\x81\xa4type\xa1\xff"
# Nesting past Python's recursion limit in an Any field (kv_params, kv_transfer_params).
DEEP_ANY = wire.encode(
    wire.Handoff(request_id="r", transfer_id="t", prefill_engine_id="p", first_token_id=None,
                 prefill_started_at=0.0, prefill_finished_at=0.0, kv_transfer_params={"k": []})
).replace(b"\xa1k\x90", b"\xa1k" + b"\x91" * 1000 + b"\x90")


# ------------------------------------------------------------------ coverage guard


def _message_kinds(base: type) -> set[type]:
    """The message kinds under ``base``: its subclasses that no other class extends (a base
    of shared fields, such as ``wire.TransferOutcome``, is no message of its own)."""
    return {kind for sub in base.__subclasses__() for kind in (_message_kinds(sub) or {sub})}


def test_every_internal_message_is_fuzzed():
    assert _message_kinds(wire.Internal) == set(STRUCTS)
    assert {m for union in UNIONS for m in _members(union)} <= set(STRUCTS)


# ------------------------------------------------------------------ wire.decode


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@PER_KIND
@given(data=st.binary(max_size=200))
@example(data=BAD_UTF8_TAG)
def test_decode_of_arbitrary_bytes_only_refuses(kind, data):
    _decodes_or_refuses(data, kind)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@PER_KIND
@given(value=MSGPACK_OBJECTS)
def test_decode_of_arbitrary_msgpack_values_only_refuses(kind, value):
    _decodes_or_refuses(msgspec.msgpack.encode(value), kind)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@settings(PER_KIND, phases=[Phase.explicit, Phase.generate])  # shrinking st.data() draws takes minutes
@given(data=st.data())
def test_decode_of_a_damaged_message_only_refuses(kind, data):
    _decodes_or_refuses(data.draw(mutated(kind)), kind)


def test_decode_refuses_invalid_utf8_in_a_string_field():
    for kind in (wire.CancelJob, wire.PrefillMessage):
        _decodes_or_refuses(BAD_UTF8_TAG, kind)


def test_decode_refuses_nesting_past_the_recursion_limit():
    _decodes_or_refuses(DEEP_ANY, wire.Handoff)


@pytest.mark.parametrize("kind", KINDS, ids=_name)
@PER_KIND
@given(data=st.data())
def test_valid_messages_round_trip(kind, data):
    message = data.draw(messages(kind))
    decoded = wire.decode(wire.encode(message), kind)
    assert type(decoded) is type(message)
    assert decoded == message


# ------------------------------------------------------------------ kvpush.generate

VOCAB, MAX_LEN = 100, 64
VALIDATOR = RequestValidator(lambda text: [ord(c) % 100 for c in text], vocab_size=VOCAB, max_model_len=MAX_LEN)
GENERATE_FIELDS = [f.name for f in mi.type_info(wire.GenerateRequest).fields]
GENERATE_LIKE = st.dictionaries(
    st.sampled_from(GENERATE_FIELDS) | st.text(max_size=8),
    JSON_VALUES | st.lists(st.integers(-5, 200), max_size=80) | st.sampled_from(["push", "pull"]),
    max_size=8,
)


def _validates_or_rejects(data: bytes) -> None:
    try:
        request = VALIDATOR.validate(data)
    except RequestError:
        return
    assert isinstance(request, ValidRequest)
    assert 0 < len(request.prompt_token_ids) < MAX_LEN
    assert all(0 <= t < VOCAB for t in request.prompt_token_ids)
    assert 1 <= len(request.request_id) <= MAX_REQUEST_ID_LEN
    assert 1 <= request.sampling.max_tokens <= MAX_LEN - len(request.prompt_token_ids)
    assert request.sampling.temperature >= 0


@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b'{"prompt": "\xff"}')
def test_validate_of_arbitrary_bytes_raises_only_request_errors(data):
    _validates_or_rejects(data)


@FUZZ
@given(value=JSON_VALUES | GENERATE_LIKE)
def test_validate_of_arbitrary_json_raises_only_request_errors(value):
    _validates_or_rejects(json.dumps(value).encode())


@FUZZ
@given(value=GENERATE_LIKE)
def test_decode_generate_request_only_refuses(value):
    try:
        body = wire.decode_json(json.dumps(value).encode(), wire.GenerateRequest)
    except msgspec.MsgspecError:
        return
    assert isinstance(body, wire.GenerateRequest)


REQUEST_ID_CHARS = st.sampled_from("-/_=." + string.ascii_letters + string.digits)


@FUZZ
@given(prompt=st.text(min_size=1, max_size=MAX_LEN - 1), request_id=st.text(REQUEST_ID_CHARS, min_size=1, max_size=20),
       room_used=st.floats(0, 1), temperature=st.floats(0, 2))
def test_a_valid_prompt_request_is_accepted(prompt, request_id, room_used, temperature):
    max_tokens = max(1, round((MAX_LEN - len(prompt)) * room_used))  # up to all the context leaves
    body = json.dumps({"prompt": prompt, "request_id": request_id, "max_tokens": max_tokens,
                       "temperature": temperature}).encode()
    request = VALIDATOR.validate(body)
    assert (request.request_id, request.prompt_token_ids) == (request_id, [ord(c) % 100 for c in prompt])
    assert request.sampling.max_tokens == max_tokens


# ------------------------------------------------------------------ kvpush.cancel


@FUZZ
@given(data=st.binary(max_size=120) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
@example(data=b'{"request_id": "\xff"}')
def test_cancel_request_decode_only_refuses(data):
    try:
        cancel = wire.decode_json(data, wire.CancelRequest)
    except msgspec.MsgspecError:  # what the scheduler catches
        return
    assert isinstance(cancel.request_id, str)


# ------------------------------------------------------------------ replies (a client's inbox, kvpush.final)

REPLY_TAGS = {wire.TokenChunk: "chunk", wire.FinalReply: "final", wire.ErrorReply: "error"}
REPLY_FIELDS = sorted({f.name for k in REPLY_TAGS for f in mi.type_info(k).fields} | {"type"})
REPLY_LIKE = st.dictionaries(
    st.sampled_from(REPLY_FIELDS) | st.text(max_size=8),
    JSON_VALUES | st.sampled_from(list(REPLY_TAGS.values())),
    max_size=8,
)
REPLY_DECODERS = [(wire.decode_reply, wire.Reply), (wire.decode_last, wire.LastMessage)]


@pytest.mark.parametrize("decode, kind", REPLY_DECODERS, ids=["Reply", "LastMessage"])
@FUZZ
@given(data=st.binary(max_size=200) | (JSON_VALUES | REPLY_LIKE).map(lambda v: json.dumps(v).encode()))
@example(data=b'{"type": "error", "request_id": "\xff", "error": {"code": "x", "message": "y"}}')
@example(data=b"[" * 5000)
def test_a_reply_decode_only_refuses(decode, kind, data):
    try:
        reply = decode(data)
    except msgspec.MsgspecError:
        return
    assert isinstance(reply, _members(kind))


@PER_KIND
@given(data=st.data())
def test_replies_round_trip_carrying_their_tag_and_every_field(data):
    """Version 7 adds ``type`` to a reply's JSON and keeps every field version 6 had."""
    reply = data.draw(messages(wire.Reply))
    if isinstance(reply, wire.FinalReply):  # JSON has no infinity
        assume(all(math.isfinite(t) for t in msgspec.structs.astuple(reply.timings)))
    if isinstance(reply, wire.TokenChunk):  # nor does a logprob on the wire (-inf is sent as -9999.0)
        assume(all(math.isfinite(c.logprob) for position in reply.logprobs or [] for c in position))
        assume(all(math.isfinite(c.logprob) for position in reply.prompt_logprobs or [] for c in position or []))
    encoded = wire.encode_json(reply)
    assert wire.decode_reply(encoded) == reply
    fields = msgspec.json.decode(encoded)
    assert fields.pop("type") == REPLY_TAGS[type(reply)]
    assert set(fields) == {f.name for f in mi.type_info(type(reply)).fields}


def test_an_untagged_version_6_reply_is_refused():
    untagged = b'{"request_id": "r", "token_ids": [1], "text": "a", "finished": false, "seq": 0}'
    with pytest.raises(msgspec.ValidationError, match="type"):
        wire.decode_reply(untagged)


def test_a_chunk_is_not_a_last_message():
    chunk = wire.encode_json(wire.TokenChunk("r", [1], "a"))
    with pytest.raises(msgspec.ValidationError):
        wire.decode_last(chunk)


# ------------------------------------------------------------------ request_id_of


@FUZZ
@given(data=st.binary(max_size=200) | (JSON_VALUES | GENERATE_LIKE).map(lambda v: json.dumps(v).encode()))
@example(data=b"[" * 5000)
def test_request_id_of_never_raises(data):
    request_id = request_id_of(data)
    assert isinstance(request_id, str) and len(request_id) <= MAX_REQUEST_ID_LEN


@FUZZ
@given(request_id=st.text(max_size=200))
@example(request_id="\ud800")
def test_request_id_of_gives_an_id_an_error_reply_can_carry(request_id):
    body = json.dumps({"request_id": request_id})  # ASCII, \u escapes: lone surrogates pass
    found = request_id_of(body.encode())
    assert found == request_id[:MAX_REQUEST_ID_LEN] or not found
    wire.encode_json(wire.ErrorReply(found, wire.ErrorBody("invalid_field", "x")))


# ------------------------------------------------------------------ producer notifications


@FUZZ
@given(message=st.binary(max_size=60) | st.text(max_size=40).map(str.encode))
@example(message=b"t:1:" + b"9" * 5000 + b":0:1:tag")
@example(message=b"\xff:0:1:0:1:tag")
@example(message=b"t:0:1:3:2:tag")  # a part outside its parts
def test_parse_notification_raises_only_value_error(message):
    try:
        note = parse_notification(message)
    except ValueError:  # UnicodeDecodeError is one
        return
    assert isinstance(note.transfer_id, str) and isinstance(note.rank, int) and isinstance(note.num_ranks, int)


@FUZZ
@given(transfer_id=st.text(max_size=40), rank=st.integers(0, 1000), num_ranks=st.integers(1, 1000),
       blocks=st.lists(st.integers(0, 10**6), max_size=8), parts=st.integers(1, 128), data=st.data())
def test_notifications_round_trip(transfer_id, rank, num_ranks, blocks, parts, data):
    tag = block_tag("key", blocks)
    part = data.draw(st.integers(0, parts - 1))
    assert parse_notification(notification(transfer_id, rank, num_ranks, tag, part, parts)) == Notification(
        transfer_id, rank, num_ranks, tag, part, parts)


# ------------------------------------------------------------------ pairing checks

READY = st.builds(
    ReadyPrefill, request_id=st.text(max_size=10), transfer_id=st.text(max_size=10),
    block_ids=st.lists(MSGPACK_INT, max_size=8), traceparent=st.text(max_size=10),
    mode=st.sampled_from(["push", "pull"]), num_tokens=MSGPACK_INT, decode_engine_id=st.text(max_size=10),
    transfer_key=st.text(max_size=10),
)


@FUZZ
@given(registration=messages(wire.Registration), ready=READY)
def test_pair_problem_never_raises(registration, ready):
    problem = pair_problem(registration, ready)
    assert problem is None or (isinstance(problem, str) and problem)


@FUZZ
@given(registration=messages(wire.Registration), ready=READY, cached=st.integers(0, 10))
def test_pair_problem_accepts_a_matching_pair(registration, ready, cached):
    assume(ready.block_ids)  # a prompt has a token, so a block
    first_block = cached % len(ready.block_ids)  # decode's cache held that many of the prompt's blocks
    matching = msgspec.structs.replace(registration, decode_engine_id=ready.decode_engine_id or "d",
                                       num_tokens=ready.num_tokens, first_block=first_block,
                                       block_ids=list(range(len(ready.block_ids) - first_block)),
                                       transfer_key=ready.transfer_key)
    assert pair_problem(matching, ready) is None
    assert sources(matching, ready) == ready.block_ids[first_block:]


@FUZZ
@given(registration=messages(wire.Registration), ready=READY)
def test_pair_problem_refuses_a_registration_whose_blocks_do_not_cover_the_rest_of_the_prompt(registration, ready):
    fits = 0 <= registration.first_block < len(ready.block_ids) and (
        len(registration.block_ids) == len(ready.block_ids) - registration.first_block)
    assume(not fits)
    matching = msgspec.structs.replace(registration, decode_engine_id=ready.decode_engine_id or "d",
                                       num_tokens=ready.num_tokens, transfer_key=ready.transfer_key)
    assert "registration" in pair_problem(matching, ready)


@FUZZ
@given(registration=messages(wire.Registration), ready=READY)
def test_pair_problem_refuses_a_registration_without_the_transfers_key(registration, ready):
    assume(registration.transfer_key != ready.transfer_key)
    matching = msgspec.structs.replace(registration, decode_engine_id=ready.decode_engine_id or "d",
                                       num_tokens=ready.num_tokens, block_ids=list(range(len(ready.block_ids))))
    assert pair_problem(matching, ready) == "the registration does not carry the transfer's key"


REGIONS = st.lists(strategy_for(mi.type_info(wire.KvRegion)), max_size=4)


@FUZZ
@given(local=REGIONS, remote=messages(wire.AgentInfo), num_blocks=MSGPACK_INT,
       local_blocks=st.lists(MSGPACK_INT, max_size=6), remote_blocks=st.lists(MSGPACK_INT, max_size=6))
def test_block_problem_never_raises(local, remote, num_blocks, local_blocks, remote_blocks):
    layout = SimpleNamespace(regions=local, num_blocks=num_blocks)
    problem = kv_layout.copy_problem(layout, remote, local_blocks, remote_blocks)
    assert problem is None or (isinstance(problem, str) and problem)
    assert (kv_layout.compatible(local, remote.regions) is None) or problem is not None


@FUZZ
@given(local=REGIONS, remote=REGIONS)
def test_compatible_is_none_or_a_reason(local, remote):
    problem = kv_layout.compatible(local, remote)
    same = len(local) == len(remote) and all(a.block_len == b.block_len for a, b in zip(local, remote))
    assert (problem is None) == same

