"""Every message kvpush puts on NATS, and the subject each one travels on, by plane:

- ``subjects``: the subjects, and the table of who publishes and who subscribes on each
  (``SUBJECTS``), from which ``kvpush.shared.permissions`` derives every NATS user's rights;
- ``identity``: which names may be identities and request ids, and how a receiver checks
  who sent a message (``forged_sender``) and where it may answer (``reply_problem``);
- ``public``: the client's JSON: requests, replies, path reports;
- ``internal``: the services' msgpack, scheduler <-> worker and scheduler <-> scheduler;
- ``transfers``: the KV plane's msgpack, between connectors (agents, registrations, moves,
  completions);
- ``kv_params``: the worker service <-> its engine's connector (vLLM's per-request dicts);
- ``durable``: JetStream's buckets and streams, and who may write on them (``DURABLE``);
- ``codec``: encoding and decoding, once per type, that raise only msgspec's errors.

docs/protocol.md writes the tables out, with the protocol's history (``PROTOCOL_VERSION``).
Everything is re-exported here: ``from kvpush.shared import wire; wire.DecodeJob``.
"""

from kvpush.shared.wire.subjects import (GENERATE_SUBJECT, CANCEL_SUBJECT, SCHEDULER_QUEUE_GROUP, INVALID_SUBJECT,
                                         SCHEDULER_STATUS_SUBJECT, FINAL_SUBJECT, CLIENT_INBOX_PREFIX,
                                         SERVICE_INBOX_PREFIX, Subject, SubjectTemplate, SubjectTree, OWNED_GENERATE,
                                         OWNED_CANCEL, OWNED_FINAL, OWNED_STATUS, SCHEDULER_HEARTBEATS, INTAKE,
                                         HEARTBEATS, PREFILL_JOBS, DECODE_JOBS, PROGRESS, TOKENS_SENT, HANDOFFS,
                                         KV_CONTROL, KV_COMPLETIONS, KV_MOVES, KV_AGENT, KV_AGENTS, CACHE_EVENTS,
                                         LEND_JOBS, COMPLETION_SUBJECTS, CLIENT_INBOXES, SERVICE_INBOXES,
                                         prefill_job_subject, decode_job_subject, registration_subject, move_subject,
                                         completion_subject, agent_subject, IdentityRole, Grant, Use, Route, SUBJECTS)
from kvpush.shared.wire.identity import (IDENTITY_PATTERN, identity_problem, MAX_REQUEST_ID_LEN, REQUEST_ID_PATTERN,
                                         request_id_problem, sender_of, forged_sender, owner_of, is_inbox,
                                         reply_problem)
from kvpush.shared.wire.public import (ServeMode, RequestedMode, KvPolicy, KV_POLICIES, KvChecksum, KV_CHECKSUMS,
                                       ModeChooser, StructuredOutput, ToolChoiceKind, ToolFunction, ToolCalling,
                                       GenerateRequest, CancelRequest, FinalRequest, ErrorBody, TokenLogprob,
                                       TokenChunk, Usage, RankKv, PathReport, Timings, FinalReply, ErrorReply,
                                       LastMessage, Reply, SchedulerStatus)
from kvpush.shared.wire.codec import (encode, decode, encode_json, decode_json, decode_reply, decode_last)
from kvpush.shared.wire.internal import (PROTOCOL_VERSION, Role, TransferMode, Internal, Connector, WorkerHeartbeat,
                                         SamplingSpec, PromptReport, Fetch, PrefixSource, PrefillJob, RouteReport,
                                         Continuation, CONTINUATIONS, Resume, DecodeJob, LendJob, Lent, CancelJob,
                                         PromptReady, PrefillMessage, DecodeMessage, ProgressStage, UNCLAIMED,
                                         RequestProgress, TokensSent, MAX_CACHE_KEYS, BlockKey, CacheKeys,
                                         CacheEvents, JobAck, Handoff, InvalidMessage, SchedulerHeartbeat,
                                         IntakeSettled)
from kvpush.shared.wire.transfers import (KvRegion, AgentInfo, Registration, LeaseRenewal, Revoke, KvControl,
                                          MoveTransfer, RendezvousOrder, TransferOutcome, TransferDone,
                                          TransferFailed, TransferMoved, Completion)
from kvpush.shared.wire.kv_params import (PrefillKvParams, PrefilledKv, DecodeKvParams, RECEIVED_KEY,
                                          RECOMPUTE_OF_KEY, LOAD_FAILURE_KEY, REPLAY_KEY, FETCH_KEY, FETCHED_KEY,
                                          ReceivedKv, FetchedKv, ConnectorConfig, engine_wake_address)
from kvpush.shared.wire.durable import (FLIGHTS_BUCKET, FINALS_BUCKET, FINALS_KEEP_S, FINALS_MAX_BYTES, flight_key,
                                        CLAIMS_STREAM_PREFIX, CLAIMS_SUBJECT_PREFIX, NO_DECODE, CLAIM_MAX_MSG_BYTES,
                                        CLAIMS_MAX_BYTES, claims_stream, claims_scope, claim_key, ClaimantRole,
                                        Claimant, claims_of, scheduler_claims_of, FlightRecord, StoredFinal,
                                        JETSTREAM_API, JETSTREAM_FLOW_CONTROL, JETSTREAM_ACKS, FLIGHT_RECORDS,
                                        STORED_FINALS, SCHEDULER_CLAIMS, DECODE_CLAIMS, OWN_CLAIM_READS, DURABLE)
