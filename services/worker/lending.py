"""Lending a cached prefix (``wire.LendJob``, from a scheduler): another engine is to
compute a prompt whose first blocks this engine holds in its prefix cache, and READs them
from here instead of computing them again (``wire.Fetch``).

The lend is an ordinary pull-mode prefill of the prefix and one token after it: vLLM finds
the prefix's blocks in its cache (computing only that token), and our connector holds the
request's blocks, as for any pull, until the reader's READ notification came or its lease
ran out (``kvpush.connector.producer``). Held by a running request, the blocks cannot be
evicted or reused while they are read; the reader renews the lease, and a reader that dies
stops renewing it, so they go back within one lease.

A prefix the engine no longer holds, as far as its own KV cache events say, is refused
before anything runs (``prefix_not_held``): the reader computes it instead. One evicted
between that check and the engine's step is computed again here, never served stale
(``Lent.cached_tokens`` says how much was found).
"""

from __future__ import annotations

import asyncio
import time

import structlog
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvpush.otel import attributes as A
from kvpush.otel.messaging import TEMPORARY, current_traceparent
from kvpush.services.worker.kinds import wake_engine
from kvpush.shared import wire
from kvpush.shared.block_keys import block_keys
from kvpush.shared.errors import BadJob, EngineFailed, PrefixNotHeld, to_error_body

log = structlog.get_logger("kvpush.worker")
_tracer = trace.get_tracer("kvpush.worker")


def lend_problem(job: wire.LendJob, block_size: int) -> str | None:
    """Why a lend cannot be served as asked (a sentence), or None."""
    if job.blocks <= 0:
        return "a lend of no blocks"
    if len(job.prompt_token_ids) != job.blocks * block_size + 1:
        return (f"a lend of {job.blocks} blocks of {block_size} tokens needs them and one token more, "
                f"not {len(job.prompt_token_ids)} tokens")
    return None


class Lender:
    """``keys``: the worker's view of what its engine caches (``cache_keys.CacheKeys``, kept
    by its cache relay); ``strategy``: its connector kind's (``kinds.KvpushStrategy``)."""

    def __init__(self, worker, keys, strategy):
        self.worker = worker
        self.keys = keys
        self.strategy = strategy
        self._sub = None
        self.lent = 0  # lends served, for the heartbeat's log and tests
        self.refused = 0

    async def start(self) -> None:
        self._sub = await self.worker.bus.subscribe(wire.LEND_JOBS(worker_id=self.worker.worker_id), self._on_lend)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_lend(self, msg) -> None:
        job = await self.worker.bus.decoded(msg, wire.LendJob, refuse_as=BadJob)
        if job is None or not msg.reply or not wire.is_inbox(msg.reply):
            return
        self.worker.spawn(self._answer(job, msg.reply))

    async def _answer(self, job: wire.LendJob, reply: str) -> None:
        answer = await self.lend(job)
        try:
            await self.worker.bus.publish(reply, wire.encode(answer), template=TEMPORARY)
        except Exception as exc:  # the scheduler will not hear: the reader never renews, the lease runs out
            log.warning("could not answer a lend", transfer_id=job.transfer_id, error=str(exc))

    async def lend(self, job: wire.LendJob) -> wire.Lent:
        worker = self.worker
        block_size = worker.block_size
        with _tracer.start_as_current_span(A.LEND, attributes={
                A.REQUEST_ID: job.request_id, A.TRANSFER_ID: job.transfer_id, A.WORKER_ID: worker.worker_id,
                A.BLOCKS: job.blocks}) as span:
            problem = lend_problem(job, block_size)
            held = self.keys.held_blocks(block_keys(job.prompt_token_ids[:job.blocks * block_size], block_size)) \
                if problem is None else 0
            if problem is None and held < job.blocks:
                problem = f"this engine holds {held} of the prefix's {job.blocks} blocks"
            if problem is not None:
                self.refused += 1
                error = to_error_body(PrefixNotHeld(problem))
                span.set_status(Status(StatusCode.ERROR, error.message))
                span.set_attribute(A.ERROR_CODE, error.code)
                log.info("refused a lend", transfer_id=job.transfer_id, reason=problem)
                return self._lent(job, error=error)
            return await self._hold(job, span)

    async def _hold(self, job: wire.LendJob, span) -> wire.Lent:
        from vllm import SamplingParams

        engine_request_id, kv_params = self.strategy.lend_request(job, current_traceparent())
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": kv_params})
        last = None
        started = time.monotonic()
        try:
            wake_engine(self.worker.settings)
            async for output in self.worker.engine.generate({"prompt_token_ids": job.prompt_token_ids}, params,
                                                            request_id=engine_request_id):
                last = output
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("lend failed")
            error = to_error_body(EngineFailed(f"lend failed: {exc}"))
            span.set_status(Status(StatusCode.ERROR, error.message))
            return self._lent(job, error=error)
        cached = getattr(last, "num_cached_tokens", None) or 0
        lent = getattr(last, "kv_transfer_params", None)
        span.set_attribute(A.CACHED_TOKENS, cached)
        if not lent or len(lent.get("remote_block_ids", ())) < job.blocks:
            error = to_error_body(PrefixNotHeld("the engine kept no blocks for the lend"))
            span.set_status(Status(StatusCode.ERROR, error.message))
            return self._lent(job, error=error)
        self.lent += 1
        log.info("lent a prefix", transfer_id=job.transfer_id, blocks=job.blocks, cached_tokens=cached,
                 reader=job.reader_engine_id, ms=round((time.monotonic() - started) * 1000, 1))
        return self._lent(job, kv_transfer_params=lent, cached_tokens=cached)

    def _lent(self, job: wire.LendJob, **fields) -> wire.Lent:
        return wire.Lent(transfer_id=job.transfer_id, holder_engine_id=self.worker.worker_id,
                         holder_incarnation=self.worker.incarnation, **fields)
