"""Every span name and attribute kvpush records, declared once with what it means."""

from __future__ import annotations

import msgspec

# ----------------------------------------------------------------------------- attributes
REQUEST_ID = "kvpush.request_id"  # the client's request id (or the one the scheduler made)
TRANSFER_ID = "kvpush.transfer_id"  # one prefill->decode KV transfer attempt
WORKER_ID = "kvpush.worker_id"  # the worker (= engine id) recording the span
PREFILL_WORKER = "kvpush.prefill_worker"  # prefill worker chosen for the request
DECODE_WORKER = "kvpush.decode_worker"  # decode worker chosen for the request
PROMPT_TOKENS = "kvpush.prompt_tokens"  # prompt length in tokens
COMPLETION_TOKENS = "kvpush.completion_tokens"  # tokens generated
TTFT_MS = "kvpush.ttft_ms"  # time to first token, from the scheduler receiving the request
BLOCKS = "kvpush.kv.blocks"  # KV blocks registered or pushed
BYTES = "kvpush.kv.bytes"  # bytes a WRITE moved
DESCRIPTORS = "kvpush.kv.descriptors"  # descriptor ranges a WRITE used (after coalescing)
RANK = "kvpush.kv.rank"  # the tensor-parallel rank whose transfer thread recorded the span
PEER_RANK = "kvpush.kv.peer_rank"  # the rank of the other engine a transfer copied with
RENDEZVOUS_SECOND = "kvpush.rendezvous.second"  # "registration" or "prefill": which half came last
RENDEZVOUS_WAIT_MS = "kvpush.rendezvous.wait_ms"  # how long the first half waited for the second
ERROR_CODE = "kvpush.error.code"  # the error code sent to the client or in a failure event
TRANSFER_MODE = "kvpush.transfer_mode"  # push, pull or local
PLACEMENT_REASON = "kvpush.placement.reason"  # why the scheduler served the request that way
PLACEMENT_PREFIX = "kvpush.placement."  # + the numbers the decision rested on (prefill_finish_s, ...)
CACHED_TOKENS = "kvpush.cached_tokens"  # prompt tokens an engine's prefix cache held
ATTEMPT = "kvpush.attempt"  # which try at serving the request (retries after a lost worker)
MOVED_FROM = "kvpush.moved_from"  # the decode worker a transfer moved away from
MOVE_REASON = "kvpush.move.reason"  # lost (silent) or overloaded
MIGRATED_FROM = "kvpush.migration.from"  # the decode a request's stream left mid-way
MIGRATION_WHY = "kvpush.migration.why"  # lost (silent) or stalled (no token for --stall-s)
MIGRATION_CONTINUATION = "kvpush.migration.continuation"  # reprefill or replay (wire.Continuation)
MIGRATION_SENT_TOKENS = "kvpush.migration.sent_tokens"  # tokens its client had at the break
PREFIX_CHOICE = "kvpush.prefix.choice"  # held, fetch or recompute: where the prompt's cached prefix comes from
PREFIX_HOLDER = "kvpush.prefix.holder"  # the engine holding the longest cached prefix
PREFIX_PREFIX = "kvpush.prefix."  # + the numbers the choice rested on (fetch_s, recompute_s, ...)
FETCHED_TOKENS = "kvpush.fetched_tokens"  # prompt tokens read from another engine's prefix cache
PATH_PREFIX = "kvpush.path."  # + each field of the request's path report (wire.PathReport)

ATTRIBUTES: dict[str, str] = {
    REQUEST_ID: "the client's request id (or the one the scheduler made)",
    TRANSFER_ID: "one prefill->decode KV transfer attempt",
    WORKER_ID: "the worker (= vLLM engine id) that recorded the span",
    PREFILL_WORKER: "prefill worker the scheduler chose",
    DECODE_WORKER: "decode worker the scheduler chose",
    PROMPT_TOKENS: "prompt length in tokens",
    COMPLETION_TOKENS: "tokens generated",
    TTFT_MS: "time to first token in ms, from the scheduler receiving the request",
    BLOCKS: "KV blocks registered or pushed",
    BYTES: "bytes one NIXL WRITE moved",
    DESCRIPTORS: "descriptor ranges one WRITE used, after coalescing contiguous blocks",
    RANK: "the tensor-parallel rank that made the transfer (one kv.write or kv.read span per pair of ranks)",
    PEER_RANK: "the rank of the other engine the transfer copied with",
    RENDEZVOUS_SECOND: "which half of the rendezvous arrived second: registration or prefill",
    RENDEZVOUS_WAIT_MS: "how long the first half of the rendezvous waited for the second, in ms",
    ERROR_CODE: "the error code of a failed request or transfer",
    TRANSFER_MODE: "push (decode registers, prefill writes), pull (prefill first, decode reads) or local "
                   "(decode computes the prompt)",
    PLACEMENT_REASON: "why the scheduler served the request that way (services/scheduler/placement.py)",
    PREFIX_CHOICE: "where the prompt's longest cached prefix comes from (services/scheduler/prefix_sources.py): "
                   "held by the engine computing it, fetched from its holder over NIXL, or recomputed",
    PREFIX_HOLDER: "the engine whose prefix cache holds the most of the prompt",
    PREFIX_PREFIX + "held_tokens": "of the prompt, what the holder's prefix cache likely holds",
    PREFIX_PREFIX + "own_tokens": "of the prompt, what the engine computing it holds itself",
    PREFIX_PREFIX + "fetch_s": "predicted seconds to fetch the difference: a lend's fixed cost, the holder's queue, "
                               "the bytes over the link",
    PREFIX_PREFIX + "fetch_tokens": "the tokens a fetch would bring: the holder's whole blocks the engine lacks",
    PREFIX_PREFIX + "holder_step_s": "predicted seconds the holder's engine takes before it runs the lend (its queue, "
                                     "up to a step's worth, at its rate)",
    PREFIX_PREFIX + "recompute_s": "predicted seconds to compute the difference on the engine computing the prompt",
    FETCHED_TOKENS: "prompt tokens read from another engine's prefix cache (neither computed nor sent again)",
    PLACEMENT_PREFIX + "prefill_finish_s": "predicted seconds until the chosen prefill would compute the prompt",
    PLACEMENT_PREFIX + "prefill_wait_s": "predicted seconds the prompt would queue on that prefill",
    PLACEMENT_PREFIX + "prefill_tokens_per_s": "that prefill's measured throughput",
    PLACEMENT_PREFIX + "prefill_cached_tokens": "of the prompt, what that prefill's prefix cache likely holds",
    PLACEMENT_PREFIX + "prompt_tokens": "the prompt's length",
    PLACEMENT_PREFIX + "decode_running": "requests the chosen decode runs (and was sent since its heartbeat)",
    PLACEMENT_PREFIX + "decode_waiting": "requests waiting in the chosen decode's engine",
    CACHED_TOKENS: "prompt tokens the engine's prefix cache held (neither computed nor transferred)",
    ATTEMPT: "which try at serving the request: 2 and up are retries after a worker was lost",
    MOVED_FROM: "the decode worker a transfer moved away from (scheduler.move)",
    MOVE_REASON: "why it moved: its decode was lost (silent) or overloaded",
    MIGRATED_FROM: "the decode a request's stream left mid-way (scheduler.migrate)",
    MIGRATION_WHY: "why it left: its decode was lost (silent) or stalled (streaming, no token for --stall-s)",
    MIGRATION_CONTINUATION: "how the new decode resumes: reprefill (prompt plus the tokens sent) or replay "
                            "(the engine replays the tokens sent: seeds, grammars, stop strings)",
    MIGRATION_SENT_TOKENS: "tokens its client had when the stream broke",
    PATH_PREFIX: "the request's path report (wire.PathReport), one attribute per field: the mode and who chose "
                 "it, its workers and attempts, where its prompt's tokens came from; on the decode span and the "
                 "gateway's root span",
}


def path_attributes(path) -> dict:
    """A ``wire.PathReport`` as span attributes (its unknown counts left out). A list of
    structs (``received_by_rank``) becomes one list attribute per field of theirs
    (``kvpush.path.received_by_rank.bytes``: every rank's, in order): OpenTelemetry takes
    scalars and lists of scalars only, and drops anything else with a warning."""
    attributes = {}
    for name, value in msgspec.structs.asdict(path).items():
        if value is None:
            continue
        if isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
            for field in value[0].__struct_fields__:
                attributes[f"{PATH_PREFIX}{name}.{field}"] = [getattr(item, field) for item in value]
        else:
            attributes[f"{PATH_PREFIX}{name}"] = value
    return attributes

# ----------------------------------------------------------------------------- business spans
SCHEDULER_QUEUE = "scheduler.queue"  # request received -> the scheduler starts on it
SCHEDULER_DISPATCH = "scheduler.dispatch"  # pick workers, send both jobs, get both acks
SCHEDULER_WAIT_PREFILL = "scheduler.wait_prefill"  # pull: prefill job sent -> its handoff arrived
SCHEDULER_TAKEOVER = "scheduler.takeover"  # a flight whose scheduler was lost, taken over by another
SCHEDULER_MOVE = "scheduler.move"  # push: the transfer moved to another decode before its write
SCHEDULER_LEND = "scheduler.lend"  # ask the engine holding a prompt's prefix to lend it (its answer)
LEND = "lend"  # a lend on the holder's worker: hold the prefix's blocks for the reader's READ
SCHEDULER_MIGRATE = "scheduler.migrate"  # a stream whose decode was lost or stalled, continued on another
PREFILL = "prefill"  # a prefill job on its worker
PREFILL_QUEUE = "prefill.queue"  # job received -> vLLM schedules the prompt
PREFILL_COMPUTE = "prefill.compute"  # vLLM computes the prompt
DECODE = "decode"  # a decode job on its worker, to the final reply
DECODE_WAIT_KV = "decode.wait_kv"  # job received -> vLLM schedules it with all KV present
DECODE_QUEUE = "decode.queue"  # local: job received -> vLLM schedules the prompt
DECODE_FIRST_TOKEN = "decode.first_token"  # scheduled -> first token out
DECODE_GENERATE = "decode.generate"  # first token -> last token
KV_REGISTER = "kv.register"  # decode allocated blocks and sent the registration
KV_RENDEZVOUS = "kv.rendezvous"  # first half arrived -> second half arrived
KV_WRITE = "kv.write"  # push: descriptor preparation, post, completion (prefill's transfer thread)
KV_READ = "kv.read"  # pull: the same, as a READ on decode's transfer thread
KV_TRANSFER_PREPARE = "kv.transfer.prepare"  # build and coalesce descriptors
KV_TRANSFER = "kv.transfer"  # WRITE or READ posted -> NIXL reports it done
KV_WAIT = "kv.wait"  # decode worker: blocks registered -> every producer's notification
KV_CHECKSUM = "kv.checksum"  # a checksum of a transfer's blocks: prefill computes it, decode checks it

SPANS: dict[str, str] = {
    SCHEDULER_QUEUE: "request received -> the scheduler starts on it",
    SCHEDULER_DISPATCH: "pick workers and send the jobs (push: both at once; pull: prefill, then decode)",
    SCHEDULER_WAIT_PREFILL: "pull: prefill job sent -> the prefill's handoff arrived",
    SCHEDULER_TAKEOVER: "a flight whose scheduler was lost: fence its attempt, then finish it here",
    SCHEDULER_MOVE: "push: its decode was lost before the KV was written; the transfer moved to another decode "
                    "(kvpush.decode_worker) with nothing recomputed, or (kvpush.error.code) could not",
    SCHEDULER_MIGRATE: "mid-stream: its decode was lost or stalled after tokens went out; the old decode "
                       "fenced, a new attempt resumes after the last token its client has",
    SCHEDULER_LEND: "ask the engine holding the prompt's longest cached prefix to hold it for a READ; its answer",
    LEND: "the holder's worker: its engine holds the prefix's blocks (cache hits) for the reader's READ, "
          "or refuses (prefix_not_held) before any READ",
    PREFILL: "a prefill job on its worker",
    PREFILL_QUEUE: "job received -> vLLM schedules the prompt",
    PREFILL_COMPUTE: "vLLM computes the prompt",
    DECODE: "a decode job on its worker, to the final reply",
    DECODE_WAIT_KV: "job received -> vLLM schedules it with all KV present",
    DECODE_QUEUE: "local: job received -> vLLM schedules the prompt (decode computes it)",
    DECODE_FIRST_TOKEN: "scheduled with KV -> first token out",
    DECODE_GENERATE: "first token -> last token",
    KV_REGISTER: "decode allocated blocks and published the registration",
    KV_RENDEZVOUS: "first half (registration or finished prefill) -> second half",
    KV_WRITE: "push: one transfer's WRITE, on prefill's transfer thread",
    KV_READ: "pull: one transfer's READ, on decode's transfer thread",
    KV_TRANSFER_PREPARE: "build and coalesce descriptors",
    KV_TRANSFER: "WRITE or READ posted -> NIXL reports it done",
    KV_WAIT: "decode: blocks registered -> every producer rank's notification arrived",
    KV_CHECKSUM: "a checksum of a transfer's blocks (connector/checksums.py): prefill computes it before the "
                 "WRITE (or, pull, before the handoff); decode checks it over what it received before the request "
                 "runs (kvpush.error.code checksum_mismatch when it differs)",
}
