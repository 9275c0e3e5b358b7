"""How much prompt a worker holds, and how fast it computes prompts (a prefill's, or a
decode's own local ones): what its heartbeat tells the schedulers, whose placement
predicts when a new prompt would be done there.

Pure: time is passed in.
"""

from __future__ import annotations

HALF_LIFE_S = 10.0  # of busy time: the rate follows a change of load within seconds


class PromptMeter:
    def __init__(self, half_life_s: float = HALF_LIFE_S):
        self.half_life_s = half_life_s
        self.queued_tokens = 0  # prompt tokens of the jobs under way
        self._jobs = 0
        self._since = 0.0  # last event while busy
        self._tokens = 0.0  # decayed tokens done ...
        self._busy_s = 0.0  # ... over decayed busy time

    def started(self, tokens: int, now: float) -> None:
        self._account(now)
        self._jobs += 1
        self.queued_tokens += tokens

    def finished(self, tokens: int, now: float, computed: bool = True) -> None:
        """A job ended: its prompt computed, or (``computed=False``) failed or cancelled."""
        self._account(now)
        self._jobs = max(0, self._jobs - 1)
        self.queued_tokens = max(0, self.queued_tokens - tokens)
        if computed:
            self._tokens += tokens

    def _account(self, now: float) -> None:
        """Add the busy time since the last event, decaying what came before."""
        busy_s = max(0.0, now - self._since) if self._jobs else 0.0
        self._since = now
        if busy_s:
            decay = 0.5 ** (busy_s / self.half_life_s)
            self._tokens *= decay
            self._busy_s = self._busy_s * decay + busy_s

    def heartbeat_fields(self) -> dict:
        """What a worker's heartbeat says of its prompts (``wire.WorkerHeartbeat``): the prompt
        tokens it holds, and how fast it computes them."""
        return {"queued_prompt_tokens": self.queued_tokens, "prefill_tokens_per_s": self.tokens_per_s}

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per second of busy time (0 until a prompt was computed)."""
        return self._tokens / self._busy_s if self._busy_s > 0 and self._tokens > 0 else 0.0
