"""Replaying the tokens a client already has, inside the engine: a vLLM logits processor
that forces a request's first outputs to be given tokens.

A request migrated mid-stream (``kvpush.services.scheduler.migrations``) whose continuation
depends on more than the text so far (a seed, a grammar, stop strings, penalties on the
output) cannot restart from "the prompt plus the tokens sent" as a new prompt: the seeded
generator would start over, the grammar would start at its root, a stop string spanning
the break would be missed. vLLM 0.32 has no API to start any of them part-way. So the new
decode runs the request from its original prompt and replays the sent tokens as its first
outputs: each replayed step masks every logit but the sent token's, so the sampler draws
from the request's own generator exactly as it did the first time (one draw a step) and
picks that token; the grammar accepts it as any sampled token; the detokenizer and the
stop-string check see the whole output. After the last replayed token the request samples
freely, in the state the uninterrupted request had. The decode worker sends nothing of
the replayed steps (``kvpush.services.worker.answer``).

Loaded into every engine (``engine_kwargs``), inert for requests without ``REPLAY_KEY``.
It runs in the engine core, on each step's logits.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from kvpush.shared.wire import REPLAY_KEY


class ReplayTokens(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        # batch index -> (the tokens to replay, the request's output token ids: vLLM's live list)
        self._replays: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        tokens = (sampling_params.extra_args or {}).get(REPLAY_KEY)
        if tokens is not None and not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
            raise ValueError(f"{REPLAY_KEY} must be a list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the token, greedy or not

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for index in batch_update.removed:
                self._replays.pop(index, None)
            for index, params, _prompt, output in batch_update.added:
                tokens = (params.extra_args or {}).get(REPLAY_KEY) if params is not None else None
                if tokens:
                    self._replays[index] = (tokens, output)
                else:
                    self._replays.pop(index, None)
            for a, b, direction in batch_update.moved:
                at_a, at_b = self._replays.pop(a, None), self._replays.pop(b, None)
                if at_a is not None:
                    self._replays[b] = at_a
                if direction is MoveDirectionality.SWAP and at_b is not None:
                    self._replays[a] = at_b
        for index, (tokens, output) in list(self._replays.items()):
            if len(output) >= len(tokens):
                del self._replays[index]  # replayed: it samples freely now

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (tokens, output) in self._replays.items():
            step = len(output)
            if step < len(tokens):
                row = logits[index]
                row.fill_(float("-inf"))
                row[tokens[step]] = 0.0
        return logits
