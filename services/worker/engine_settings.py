"""What a worker's vLLM engine is started with: the model, its role and the KV connector
kind. Plain data: the kind's strategy (``kvpush.services.worker.kinds``) and the engine arguments
(``kvpush.services.worker.engine``) read it."""

from __future__ import annotations

from dataclasses import dataclass

from kvpush.shared import settings
from kvpush.shared.settings import FaultSettings


@dataclass
class EngineSettings:
    model: str
    role: str | None  # "prefill", "decode", or None for a plain single instance
    engine_id: str
    nats_url: str | None
    max_model_len: int = settings.MAX_MODEL_LEN
    block_size: int | None = None
    max_num_seqs: int = 16
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    connector: str = settings.CONNECTOR  # a kind of kvpush.shared.connector_kinds: ours or vLLM's own
    faults: FaultSettings = settings.FAULTS
    incarnation: str = ""  # the worker's start, carried by its connector's agents and registrations
    prefix_caching: bool = settings.PREFIX_CACHING == "on"
    push_by_layer: bool = False  # prefill with kvpush's connector: layer-wise push (``layer_wise``)
    json_whitespace: str = settings.JSON_WHITESPACE  # "any" or "none" (vLLM's disable_any_whitespace)
    kv_events_endpoint: str | None = None  # where the engine publishes its KV cache events (cache_relay)


CPU_BLOCK_MULTIPLE = 32  # vLLM 0.32's CPU attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"


def block_size_problem(block_size: int | None, on_cpu: bool) -> str | None:
    """Why an engine cannot start with ``block_size`` tokens per KV block (None: it can), said
    before vLLM loads a model to find out."""
    if block_size is None:
        return None
    if block_size <= 0:
        return f"--block-size must be a positive number of tokens, not {block_size}"
    if on_cpu and block_size % CPU_BLOCK_MULTIPLE:
        return (f"--block-size {block_size}: vLLM's CPU attention takes only multiples of {CPU_BLOCK_MULTIPLE} "
                f"tokens (32 is the smallest; GPUs default to 16)")
    return None


def layer_wise(setting: str, on_gpu: bool | None = None) -> bool:
    """``--push-by-layer``: "on", "off", or "auto" (on for an engine on a GPU, where it
    measured better; off on CPUs). ``on_gpu``: None asks torch."""
    if setting in ("on", "off"):
        return setting == "on"
    if setting != "auto":
        raise ValueError(f"--push-by-layer takes on, off or auto, not {setting!r}")
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    return on_gpu


# vLLM's step budget for an engine on CPUs when it does not chunk prompts: at least this,
# and at least the longest prompt (vLLM refuses a budget below max_model_len then).
WHOLE_PROMPT_MIN_BUDGET = 2048


def whole_prompt_steps(max_model_len: int, on_cpu: bool, emulated: bool = False) -> dict:
    """Engine arguments that keep each prompt in one step, on CPUs (else none).

    After a step that computed only part of a prompt, vLLM rewinds the request's seeded
    generator by the draw it discarded (``Generator.set_offset``). torch's CPU generators
    have no offset: on CPUs the whole engine fails ("CPU Generator does not use offset")
    as soon as a seeded, sampled request's prompt is split across steps, which chunked
    prefill does whenever a step's budget is short of it (found by tests/stack's
    single-engine reference, issue 28). So on CPUs kvpush's engines do not chunk prompts,
    and a step's budget holds the longest one; a seed then samples every token exactly
    where a single engine would, on any path. An emulated GPU keeps vLLM's GPU
    scheduling: it stands in for a GPU's timing, and seeds are not what it measures."""
    if not on_cpu or emulated:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, WHOLE_PROMPT_MIN_BUDGET)}
