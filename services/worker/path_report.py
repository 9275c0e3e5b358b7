"""A request's path report (``wire.PathReport``), from what its decode saw; and which
``kv_policy`` decode applies. Pure: no NATS, no vLLM.

Where the prompt's tokens came from, by the path the request took:

- push or pull, the KV arrived: decode's connector says (``wire.ReceivedKv``, in the
  engine's last output) how many tokens its own prefix cache held and how many came from
  prefill, in how many blocks and bytes, and what landed in each of its tensor-parallel
  ranks; prefill computed the prompt less its own cache hits (its ``wire.PromptReport``,
  unknown if it never reached decode);
- push or pull, the KV did not arrive intact and the policy is ``recompute``: decode
  computed the prompt itself, less what its prefix cache held; those tokens are
  ``recomputed_tokens`` too (prefill had computed them already);
- local: decode computed the prompt, less what its prefix cache held.

A connector of vLLM's own (the side-by-side comparison kinds) says nothing of what it
received: those counts are ``None``, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.shared import wire


def effective_policy(requested: str, worker_floor: str) -> str:
    """The request's ``kv_policy``, unless its decode worker runs ``--on-kv-failure fail``:
    the strictest wins (a deployment that may not compute prompts on decode never does)."""
    return "fail" if "fail" in (requested, worker_floor) else "recompute"


@dataclass(frozen=True)
class DecodeSaw:
    """What the decode engine said of the prompt."""

    received: wire.ReceivedKv | None = None  # the connector's, when the KV arrived from prefill
    computed_here: bool = False  # decode's engine computed the prompt (local, or after a failed transfer)
    cached_here: int | None = None  # when it did: the tokens its prefix cache held
    kv_failure: tuple[str, str] | None = None  # (code, why) the KV did not arrive intact, when it did not


def path_report(job: wire.DecodeJob, decode_worker: str, saw: DecodeSaw, kv_policy: str,
                prefill: wire.PromptReport | None) -> wire.PathReport:
    route = job.route or wire.RouteReport(chosen_by="scheduler", reason="")
    prompt_tokens = len(job.prompt_token_ids)
    local = job.mode == "local"
    report = wire.PathReport(
        mode=job.mode, chosen_by=route.chosen_by, reason=route.reason,
        prefill_worker="" if local else job.prefill_engine_id, decode_worker=decode_worker,
        attempt=route.attempt, moves=route.moves, takeovers=route.takeovers, kv_policy=kv_policy,
        migrations=route.migrations, resumed_after=list(route.resumed_after),
        continuation=job.resume.continuation if job.resume is not None else "",
        prompt_tokens=prompt_tokens,
        prefill_computed_tokens=0 if local else (
            None if prefill is None else prompt_tokens - prefill.cached_tokens - prefill.fetched_tokens),
        received_tokens=None, received_blocks=None, received_bytes=None, decode_cached_tokens=None,
        decode_computed_tokens=0, recomputed_tokens=0,
    )
    if route.prefix is not None:
        report.prefix_source = prefix_source(route.prefix, prefill)
        report.prefix_reason = route.prefix.reason
    if prefill is not None and prefill.fetched_tokens:
        report.fetched_tokens, report.fetched_from = prefill.fetched_tokens, prefill.fetched_from
    if not local and saw.computed_here:  # the KV did not arrive intact (why, if our connector said)
        report.kv_failure, report.kv_failure_reason = saw.kv_failure or ("kv_load_failed", "")
    if saw.computed_here:
        cached = saw.cached_here or 0
        report.received_tokens = report.received_blocks = report.received_bytes = 0
        report.decode_cached_tokens = cached
        report.decode_computed_tokens = prompt_tokens - cached
        if not local:
            report.recomputed_tokens = report.decode_computed_tokens
    elif saw.received is not None:
        report.received_tokens = saw.received.tokens
        report.received_blocks = saw.received.blocks
        report.received_bytes = saw.received.bytes
        report.received_by_rank = list(saw.received.by_rank)
        report.decode_cached_tokens = saw.received.local_tokens
        report.kv_checksum = saw.received.checksum
    return report


def prefix_source(prefix: wire.PrefixSource, prompt: wire.PromptReport | None) -> str:
    """Where the prompt's longest cached prefix came from: as the scheduler chose, but a
    fetch that brought nothing (refused, or its READ failed) was a recompute."""
    if prefix.choice == "fetch":
        return "fetched" if prompt is not None and prompt.fetched_tokens else "recomputed"
    return {"recompute": "recomputed"}.get(prefix.choice, prefix.choice)


def load_failure_of(kv_transfer_params: dict | None) -> tuple[str, str] | None:
    """(code, why) the first engine request's load failed, as our connector told the
    request that computed the prompt again."""
    value = (kv_transfer_params or {}).get(wire.LOAD_FAILURE_KEY)
    if not isinstance(value, dict) or not isinstance(value.get("code"), str):
        return None
    return value["code"], str(value.get("reason", ""))


def received_of(kv_transfer_params: dict | None) -> wire.ReceivedKv | None:
    """The connector's account of the KV it received, from the engine's last output."""
    value = (kv_transfer_params or {}).get(wire.RECEIVED_KEY)
    if not isinstance(value, dict):
        return None
    try:
        return wire.ReceivedKv.of(value)
    except Exception:  # msgspec.ValidationError: an engine of another version; unknown, not guessed
        return None
