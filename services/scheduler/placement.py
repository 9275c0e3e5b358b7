"""How one request is served, decided from live load: its prompt computed by the decode
itself (``local``), or by a prefill worker with the KV pushed to a decode chosen now
(``push``) or read by a decode chosen when prefill ends (``pull``).

Push saves pull's handoff (decode registers its blocks while prefill computes) but binds
the decode at arrival; the longer the prefill will take, the more that choice can be
overtaken by load. Disaggregating a short prompt costs more (a dispatch, a transfer, a
second engine's queue) than computing it where it will be decoded.

Pure: no NATS. The numbers behind every decision go on the request's trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpush.shared import settings

Policy = Literal["push", "pull", "auto"]
Mode = Literal["push", "pull", "local"]
Chooser = Literal["request", "scheduler", "auto"]  # wire.ModeChooser


@dataclass(frozen=True)
class PlacementSettings:
    policy: Policy = settings.TRANSFER_MODE
    local_below_tokens: int = settings.LOCAL_PREFILL_TOKENS  # auto: shorter prompts are computed by decode
    push_within_s: float = settings.PUSH_WITHIN_S  # auto: push when prefill should end within this
    handoff_s: float = settings.HANDOFF_S  # auto: what disaggregating adds to prefill's time (dispatch, transfer)
    decode_room: int = settings.DECODE_ROOM  # auto: a decode with fewer requests than this may compute a prompt

    def __post_init__(self) -> None:
        if self.policy not in ("push", "pull", "auto"):
            raise ValueError(f"mode must be push, pull or auto, not {self.policy!r}")
        if self.local_below_tokens < 0 or self.push_within_s < 0 or self.handoff_s < 0:
            raise ValueError("placement thresholds must be 0 or more")


@dataclass(frozen=True)
class PromptLoad:
    """Prompt work a worker holds and how fast it computes prompts, from its heartbeat
    (plus the jobs sent it since): a prefill's prompts, or a decode's local ones."""

    queued_tokens: int = 0  # prompt tokens accepted and not yet computed
    tokens_per_s: float = 0.0  # its measured prompt throughput (0: not measured yet)
    cached_tokens: int = 0  # of this prompt, what its prefix cache likely holds

    def finish_s(self, prompt_tokens: int) -> float | None:
        """When a prompt sent now would be computed, or None while the rate is unknown."""
        if self.tokens_per_s <= 0:
            return None
        return (self.queued_tokens + max(prompt_tokens - self.cached_tokens, 0)) / self.tokens_per_s


@dataclass(frozen=True)
class DecodeLoad(PromptLoad):
    running: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class Placement:
    mode: Mode
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)
    chosen_by: Chooser = "auto"


def place(prompt_tokens: int, requested: str | None, config: PlacementSettings, supported: tuple[str, ...],
          prefill: PromptLoad | None, decode: DecodeLoad | None) -> Placement:
    """``requested``: the request's own transfer_mode, which wins where the connector does it
    (``auto``: decide as ``--mode auto`` does); ``supported``: the modes the workers'
    connector does (local always works); ``prefill`` / ``decode``: the least loaded live
    worker of each role, if any."""
    numbers: dict[str, float] = {"prompt_tokens": prompt_tokens}
    if requested == "local" or (requested in ("push", "pull") and requested in supported):
        return Placement(requested, "the request asked for it", numbers, "request")
    if config.policy != "auto" and requested != "auto":
        mode = config.policy if config.policy in supported else supported[0]
        return Placement(mode, f"the scheduler runs {config.policy}", numbers, "scheduler")
    if prompt_tokens < config.local_below_tokens:
        return Placement("local", f"a prompt under {config.local_below_tokens} tokens", numbers)
    finish_s = prefill.finish_s(prompt_tokens) if prefill is not None else None
    if decode is not None:
        numbers.update(decode_running=decode.running, decode_waiting=decode.waiting)
    if finish_s is None:
        return Placement(_mode("push", supported), "no prefill rate measured yet", numbers)
    wait_s = prefill.queued_tokens / prefill.tokens_per_s
    numbers.update(prefill_wait_s=round(wait_s, 4), prefill_finish_s=round(finish_s, 4),
                   prefill_cached_tokens=prefill.cached_tokens,
                   prefill_tokens_per_s=round(prefill.tokens_per_s, 1))
    local_s = decode.finish_s(prompt_tokens) if decode is not None else None
    if local_s is not None:
        numbers.update(local_finish_s=round(local_s, 4), decode_tokens_per_s=round(decode.tokens_per_s, 1))
        if decode.running + decode.waiting < config.decode_room and local_s <= finish_s + config.handoff_s:
            return Placement("local", f"decode would compute it in {local_s:.2f} s, prefill in {finish_s:.2f} s "
                                      f"and a handoff", numbers)
    if finish_s <= config.push_within_s:
        return Placement(_mode("push", supported), f"prefill should end within {config.push_within_s:g} s",
                         numbers)
    return Placement(_mode("pull", supported), f"prefill should take {finish_s:.2f} s: choose decode when it ends",
                     numbers)


def _mode(wanted: Mode, supported: tuple[str, ...]) -> Mode:
    return wanted if wanted in supported else supported[0]
