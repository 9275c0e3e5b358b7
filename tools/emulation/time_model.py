"""How long a step of a named model takes on named GPUs: a roofline, pure arithmetic.

A step is one forward of an engine: a batch of requests, each with some new tokens (a whole
prompt, a chunk of one, or the one token a decode step adds) over the context it already
has. Its time is the larger of

- compute: FLOPs (2 per weight per new token, plus attention's QK^T and AV over each new
  token's context) against the deployment's peak FLOP/s × a measured efficiency, and
- memory: bytes read from HBM (the weights once per step, each request's KV context) and
  written (the new tokens' KV) against HBM bandwidth × a measured efficiency,

plus tensor parallelism's all-reduces (two per layer, over NVLink) and a fixed cost per step
(the engine's scheduling, launches and sampling). Everything is divided over the ``tp`` GPUs
that run one instance. Nothing here imports vLLM, NIXL or NATS; the numbers and their sources
live in :mod:`kvpush.tools.emulation.catalog`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Gpu", "ModelShape", "Efficiency", "Deployment", "Request", "StepTime",
           "step_time", "prefill_seconds", "decode_step_seconds", "shaped_link_rate",
           "transfer_to_prefill_ratio"]


@dataclass(frozen=True)
class Gpu:
    name: str
    dense_bf16_flops: float  # FLOP/s, dense (no sparsity)
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float  # one direction, per GPU


@dataclass(frozen=True)
class ModelShape:
    name: str
    parameters: float  # all weights, counted once
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int = 2  # bf16 weights and KV

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    @property
    def weight_bytes(self) -> float:
        return self.parameters * self.bytes_per_value


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet's peaks that real serving reaches (each from a measurement)."""

    flops: float  # model FLOPs utilisation in compute-bound steps (prefill)
    hbm: float  # bandwidth utilisation in memory-bound steps (decode)
    nvlink: float  # of NVLink bandwidth in all-reduces
    step_overhead_s: float  # fixed cost per engine step


@dataclass(frozen=True)
class Deployment:
    """One engine instance: a model on ``tp`` GPUs, and the link to other instances."""

    model: ModelShape
    gpu: Gpu
    tp: int
    efficiency: Efficiency
    link_bytes_per_s: float  # between two instances (all NICs of one node together)

    @property
    def name(self) -> str:
        return f"{self.model.name}@{self.gpu.name}x{self.tp}"


@dataclass(frozen=True)
class Request:
    """One request's part of a step: ``new`` tokens computed over ``context`` tokens in all
    (the new ones included), as vLLM's attention metadata says (query and sequence length)."""

    new: int
    context: int

    def __post_init__(self) -> None:
        if self.new < 0 or self.context < self.new:
            raise ValueError(f"a request needs 0 <= new <= context, got new={self.new} context={self.context}")


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    memory_s: float
    allreduce_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.allreduce_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _attention_flops(model: ModelShape, request: Request) -> float:
    # New token j (0-based) of n, after a prefix of p = context - n tokens, attends to p + j + 1
    # tokens: QK^T and AV are 2 multiply-adds per (query head, dim, key) each, 4 FLOPs.
    n, prefix = request.new, request.context - request.new
    attended = n * prefix + n * (n + 1) / 2
    return 4.0 * model.layers * model.heads * model.head_dim * attended


def step_time(deployment: Deployment, batch: list[Request] | tuple[Request, ...]) -> StepTime:
    """The modeled time of one engine step over ``batch`` (empty: no step, zero)."""
    model, gpu, tp, eff = deployment.model, deployment.gpu, deployment.tp, deployment.efficiency
    new_tokens = sum(r.new for r in batch)
    if new_tokens == 0:
        return StepTime(0.0, 0.0, 0.0, 0.0)
    flops = 2.0 * model.parameters * new_tokens + sum(_attention_flops(model, r) for r in batch)
    kv_read = sum(r.context - r.new for r in batch) * model.kv_bytes_per_token
    kv_written = new_tokens * model.kv_bytes_per_token
    hbm_bytes = model.weight_bytes + kv_read + kv_written
    compute_s = flops / (tp * gpu.dense_bf16_flops * eff.flops)
    memory_s = hbm_bytes / (tp * gpu.hbm_bytes_per_s * eff.hbm)
    allreduce_s = 0.0
    if tp > 1:
        # Two all-reduces per layer of the activations (bf16), ring: 2 (tp-1)/tp of the data
        # crosses each GPU's link.
        activation_bytes = new_tokens * model.hidden * model.bytes_per_value
        per_gpu = 2 * model.layers * activation_bytes * 2 * (tp - 1) / tp
        allreduce_s = per_gpu / (gpu.nvlink_bytes_per_s * eff.nvlink)
    return StepTime(compute_s, memory_s, allreduce_s, eff.step_overhead_s)


def prefill_seconds(deployment: Deployment, prompt_tokens: int) -> float:
    """A whole prompt as one step, alone."""
    return step_time(deployment, [Request(prompt_tokens, prompt_tokens)]).seconds


def decode_step_seconds(deployment: Deployment, contexts: list[int]) -> float:
    """One decode step: one new token for each request, over its context."""
    return step_time(deployment, [Request(1, c) for c in contexts]).seconds


def transfer_seconds(deployment: Deployment, prompt_tokens: int) -> float:
    """A prompt's KV across the deployment's link, at its full rate."""
    return prompt_tokens * deployment.model.kv_bytes_per_token / deployment.link_bytes_per_s


def transfer_to_prefill_ratio(deployment: Deployment, prompt_tokens: int) -> float:
    """How long the prompt's KV takes to cross the link, against how long its prefill took."""
    transfer = prompt_tokens * deployment.model.kv_bytes_per_token / deployment.link_bytes_per_s
    return transfer / prefill_seconds(deployment, prompt_tokens)


def shaped_link_rate(deployment: Deployment, emulating_kv_bytes_per_token: int, dilation: float) -> float:
    """The rate (bytes/s) a link carrying the emulating model's KV must have so that its
    transfer time, against the dilated prefill time, is what the deployment's would be: the
    same ratio at every prompt length, since both sides scale with the tokens."""
    if dilation <= 0:
        raise ValueError("dilation must be positive")
    return (deployment.link_bytes_per_s * emulating_kv_bytes_per_token
            / deployment.model.kv_bytes_per_token / dilation)


def recompute_seconds(deployment: Deployment, prefix_tokens: int, suffix_tokens: int) -> float:
    """What computing a prompt's ``prefix_tokens`` again adds to its step, against reading
    them from another engine and computing only the ``suffix_tokens`` over them."""
    total = prefix_tokens + suffix_tokens
    return (step_time(deployment, [Request(total, total)]).seconds
            - step_time(deployment, [Request(suffix_tokens, total)]).seconds)


def fetch_seconds(deployment: Deployment, prefix_tokens: int, fixed_s: float,
                  link_bytes_per_s: float | None = None) -> float:
    """Reading a prefix's KV from the engine holding it: a fixed cost (the lend's round trip
    and the holder's step) and its bytes over the link (the deployment's unless given)."""
    rate = link_bytes_per_s or deployment.link_bytes_per_s
    return fixed_s + prefix_tokens * deployment.model.kv_bytes_per_token / rate


def fetch_break_even_link(deployment: Deployment, prefix_tokens: int, suffix_tokens: int,
                          fixed_s: float = 0.0) -> float | None:
    """The link rate (bytes/s) below which fetching the prefix takes longer than computing
    it again; None if the fixed cost alone is longer (fetching never pays)."""
    spare = recompute_seconds(deployment, prefix_tokens, suffix_tokens) - fixed_s
    if spare <= 0:
        return None
    return prefix_tokens * deployment.model.kv_bytes_per_token / spare


def fetch_break_even_tokens(deployment: Deployment, suffix_tokens: int, fixed_s: float,
                            link_bytes_per_s: float | None = None, limit: int = 1 << 20) -> int | None:
    """The shortest prefix (a multiple of 16 tokens) that is faster to fetch than to
    compute again, or None up to ``limit``."""
    tokens = 16
    while tokens <= limit:
        if fetch_seconds(deployment, tokens, fixed_s, link_bytes_per_s) < recompute_seconds(deployment, tokens,
                                                                                             suffix_tokens):
            low, high = tokens // 2, tokens
            while high - low > 16:
                middle = (low + high) // 32 * 16
                if fetch_seconds(deployment, middle, fixed_s, link_bytes_per_s) < recompute_seconds(
                        deployment, middle, suffix_tokens):
                    high = middle
                else:
                    low = middle
            return high
        tokens *= 2
    return None
