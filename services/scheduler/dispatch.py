"""The jobs a scheduler sends for one attempt at a flight, from the flight and the workers
chosen for it.

Pure: no NATS. What each connector makes of a job (engine request ids, vLLM's own
``kv_transfer_params``) is the worker's business (``kvpush.services.worker.engine``); the
scheduler only passes on what the prefill side says about itself: its heartbeat's
``kv_params`` in push, or the handoff's ``kv_transfer_params`` in pull.
"""

from __future__ import annotations

import random
from typing import Any

from kvpush.services.scheduler.flights import Flight
from kvpush.services.scheduler.prefix_sources import PrefixPlan
from kvpush.shared import settings, wire


def checksum_for(transfer_id: str, setting: str, fraction: float = settings.KV_CHECKSUM_FRACTION) -> bool:
    """Whether a transfer's KV gets an end-to-end checksum (``--kv-checksums``): every
    one (``full``), none (``off``), or ``fraction`` of them (``sampled``), decided from the
    transfer's id, so a retry (a new id) is decided anew."""
    if setting == "full":
        return True
    if setting != "sampled":
        return False
    return random.Random(transfer_id).random() < fraction


def prefill_job(flight: Flight, kv_checksums: str = "off", fetch: wire.Fetch | None = None) -> wire.PrefillJob:
    """Push: decode is already chosen (its registration is the only one prefill may write
    to). Pull: decode is chosen after prefill. ``kv_checksums``: the scheduler's setting.
    ``fetch``: the prompt's first blocks, lent by the engine holding them."""
    return wire.PrefillJob(
        request_id=flight.request_id,
        transfer_id=flight.transfer_id,
        prompt_token_ids=flight.attempt_prompt,
        received_at=flight.received_at,
        mode=flight.mode,
        decode_engine_id=flight.decode_id if flight.mode == "push" else "",
        transfer_key=flight.transfer_key,
        # a migrated request's client has them already (with its first chunk)
        prompt_logprobs=flight.request.sampling.prompt_logprobs if flight.resume is None else None,
        kv_checksum=checksum_for(flight.transfer_id, kv_checksums),
        fetch=fetch,
    )


def decode_job(flight: Flight, prefill_kv: dict[str, Any] | None,
               prompt: wire.PromptReport | None = None) -> wire.DecodeJob:
    """``prefill_kv``: push, the prefill's heartbeat ``kv_params`` (how to reach it); pull,
    what its engine returned in the handoff (where the prompt's blocks are); local, None
    (no prefill: the decode computes the prompt). ``prompt``: pull, what prefill said of
    the prompt (push passes it on later: ``prompt_ready``)."""
    request = flight.request
    return wire.DecodeJob(
        request_id=request.request_id,
        transfer_id=flight.transfer_id,
        prompt_token_ids=flight.attempt_prompt,
        sampling=request.sampling,
        prefill_engine_id=flight.prefill_id,
        reply_to=flight.reply_to,
        received_at=flight.received_at,
        mode=flight.mode,
        kv_transfer_params=dict(prefill_kv or {}),
        transfer_key=flight.transfer_key,
        prefill_incarnation=flight.prefill_incarnation,
        prompt=prompt,
        route=wire.RouteReport(chosen_by=flight.mode_chosen_by, reason=flight.mode_reason, attempt=flight.attempt,
                               moves=flight.times_moved, takeovers=flight.takeovers,
                               migrations=flight.migrations, resumed_after=list(flight.resumed_after),
                               prefix=flight.prefix),
        kv_policy=flight.kv_policy,
        resume=flight.resume,
    )


def lend_job(flight: Flight, plan: PrefixPlan, reader_id: str, transfer_id: str, transfer_key: str) -> wire.LendJob:
    """Ask the plan's holder to hold the prompt's first ``plan.tokens`` for ``reader_id``'s
    READ: the prefix and one token more (the holder's engine computes that one)."""
    return wire.LendJob(request_id=flight.request_id, transfer_id=transfer_id,
                        prompt_token_ids=flight.attempt_prompt[:plan.tokens + 1],
                        blocks=plan.tokens // plan.holder.block_size, reader_engine_id=reader_id,
                        transfer_key=transfer_key)


def fetch_of(plan: PrefixPlan, lent: wire.Lent, transfer_key: str) -> wire.Fetch:
    """The prefill's READ of what the holder lent."""
    return wire.Fetch(holder_engine_id=lent.holder_engine_id, holder_incarnation=lent.holder_incarnation,
                      transfer_id=lent.transfer_id, transfer_key=transfer_key, tokens=plan.tokens,
                      lent=dict(lent.kv_transfer_params or {}))


def prompt_ready(flight: Flight, handoff: wire.Handoff) -> wire.PromptReady | None:
    """Push: what prefill said of the prompt, for the decode already generating; None
    when prefill said nothing (it failed, or is a connector of vLLM's own)."""
    if flight.mode != "push" or handoff.prompt is None or not flight.decode_id:
        return None
    return wire.PromptReady(request_id=flight.request_id, transfer_id=flight.transfer_id, prompt=handoff.prompt)
