"""The connector's scheduler side: runs inside vLLM's scheduler, never blocks it.

Push, decode: the moment vLLM allocates blocks for a request whose KV comes from a
prefill instance, publish the registration on NATS (no waiting for prefill, no extra
engine step). Pull, decode: at the same moment, tell the worker side to READ the
prefill's blocks (named in the request's parameters) into them.
Prefill, both modes: tell the worker side, in the step that computes a request's last
prompt token, which blocks hold that prompt, so the push can start right after that
step's forward pass; hold the blocks until the worker reports the KV gone (written,
or read by decode). In pull mode the block ids go back in the output's
kv_transfer_params for the scheduler to hand to decode.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from connector.bridge import NatsBridge
from connector.metadata import ExpectedKv, KvpushMetadata, PullRead, ReadyPrefill
from otel import attributes as A
from otel.messaging import context_from_traceparent
from shared import wire

_tracer = trace.get_tracer("kvpush.connector")

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class _Prefill:
    request: "Request"
    transfer_id: str
    traceparent: str
    mode: str
    decode_engine_id: str
    block_ids: list[int] | None = None  # set once announced to the worker side


class ConnectorScheduler:
    def __init__(self, engine_id: str, block_size: int, tp_size: int, bridge: NatsBridge):
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self.bridge = bridge
        self.kv_cache_manager: "KVCacheManager | None" = None
        self._prefills: dict[str, _Prefill] = {}  # prefill side, do_remote_decode requests
        self._expected: list[ExpectedKv] = []  # decode side, push: for the next metadata
        self._reads: list[PullRead] = []  # decode side, pull: for the next metadata
        self._awaiting_send: set[str] = set()  # prefill requests whose blocks we hold

    # ---------------------------------------------------------------- both sides

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and request.request_id not in self._prefills:
            self._prefills[request.request_id] = _Prefill(
                request, params["transfer_id"], params.get("traceparent", ""), params.get("mode", "push"),
                params.get("decode_engine_id", ""),
            )
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            if params.get("mode", "push") == "pull":
                self._read(request, block_ids, params)
            else:
                self._register(request, block_ids, params)
            params["do_remote_prefill"] = False  # a re-entry must not register again

    def _read(self, request: "Request", block_ids: list[int], params: dict[str, Any]) -> None:
        needed = blocks_for(len(request.prompt_token_ids or ()), self.block_size)
        self._reads.append(
            PullRead(
                request_id=request.request_id,
                transfer_id=params["transfer_id"],
                local_block_ids=list(block_ids[:needed]),
                prefill_engine_id=params["prefill_engine_id"],
                remote_block_ids=list(params["remote_block_ids"]),  # what prefill's request_finished returned
                traceparent=params.get("traceparent", ""),
            )
        )

    def _register(self, request: "Request", block_ids: list[int], params: dict[str, Any]) -> None:
        num_tokens = len(request.prompt_token_ids or ())
        registration = wire.Registration(
            transfer_id=params["transfer_id"],
            request_id=params.get("request_id", request.request_id),
            decode_engine_id=self.engine_id,
            decode_request_id=request.request_id,
            decode_tp_size=self.tp_size,
            block_ids=list(block_ids[: blocks_for(num_tokens, self.block_size)]),
            num_tokens=num_tokens,
            registered_at=time.time(),
        )
        traceparent = params.get("traceparent", "")
        with _tracer.start_as_current_span(
            A.KV_REGISTER,
            context=context_from_traceparent(traceparent),
            attributes={
                A.REQUEST_ID: registration.request_id,
                A.TRANSFER_ID: registration.transfer_id,
                A.WORKER_ID: self.engine_id,
                A.BLOCKS: len(registration.block_ids),
            },
        ):
            body = wire.encode(registration)
            self.bridge.publish(
                wire.registration_subject(params["prefill_engine_id"]), body, template="kvpush.kv.register.{engine_id}"
            )
        self._expected.append(
            ExpectedKv(request.request_id, params["transfer_id"], params.get("prefill_tp_size", 1), traceparent,
                       params["prefill_engine_id"], body)
        )

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvpushMetadata:
        meta = KvpushMetadata(
            expected=self._expected, reads=self._reads, idle=scheduler_output.total_num_scheduled_tokens == 0
        )
        self._expected, self._reads = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for request_id, prefill in self._prefills.items():
            if prefill.block_ids is not None or request_id not in scheduled:
                continue
            request = prefill.request
            # num_computed_tokens is not advanced until after this call.
            if request.num_computed_tokens + scheduled[request_id] < request.num_prompt_tokens:
                continue
            (block_ids,) = self.kv_cache_manager.get_block_ids(request_id)[:1]
            needed = blocks_for(request.num_prompt_tokens, self.block_size)
            prefill.block_ids = list(block_ids[:needed])
            meta.ready_prefills.append(
                ReadyPrefill(request_id, prefill.transfer_id, prefill.block_ids, prefill.traceparent, prefill.mode,
                             request.num_prompt_tokens, prefill.decode_engine_id)
            )
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]):
        prefill = self._prefills.pop(request.request_id, None)
        if prefill is None or prefill.block_ids is None:
            return False, None
        # Blocks stay ours until the worker reports the KV gone (get_finished).
        self._awaiting_send.add(request.request_id)
        return True, {
            "transfer_id": prefill.transfer_id,
            "prefill_engine_id": self.engine_id,
            "prefill_tp_size": self.tp_size,
            "remote_block_ids": prefill.block_ids,
        }

    def update_connector_output(self, connector_output) -> None:
        for request_id in connector_output.finished_sending or ():
            self._awaiting_send.discard(request_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting_send)
