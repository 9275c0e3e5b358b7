"""The timed model: a tiny real network that takes a named model's time on named GPUs.

vLLM loads it by its architecture name (``KvpushTimedForCausalLM``, registered by
:mod:`kvpush.tools.emulation.plugin`) from a folder that ``kvpush model build`` writes for a
``timed-*`` profile. The network is a tiny attention-only stack (:class:`TimedLayer`, vLLM's
own Attention layer) with the named model's layer count, loaded from the folder's Qwen2
weights, so its tokens are deterministic, its KV blocks are real bytes, and every layer's
hooks fire. What it adds: each forward reads its batch from vLLM's attention metadata (new
tokens and context per request), asks the time model how long the named deployment would take
for that step, multiplies by the dilation ``k``, and paces its layers to end then
(:class:`LayerPacer`).

Settings (from the model folder's ``config.json``, key ``kvpush_emulation``):
``target`` (a catalog name, e.g. ``qwen3-32b@p5en``). From the environment, so that one folder
serves every run: ``KVPUSH_EMULATION_DILATION`` (k, default 1), ``KVPUSH_EMULATION_TARGET``
(overrides the folder's target), ``KVPUSH_EMULATION_LOG`` (a file; each paced forward appends
one JSON line: batch, modeled, target, wall and busy seconds), ``KVPUSH_EMULATION_PACING``
(``layers``, the default: in a step that computes prompt tokens each layer ends at its share
of the step, and a step that only decodes waits once at its end, as sleeping between layers
costs real work; ``every-layer``: decode steps by layer too; ``step``: one wait per step).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope

from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.pacing import PACINGS, LayerPacer, paced_by_layer
from kvpush.tools.emulation.plugin import ARCHITECTURE, TARGET_ENV
from kvpush.tools.emulation.time_model import Deployment, Request, step_time

DILATION_ENV = "KVPUSH_EMULATION_DILATION"
LOG_ENV = "KVPUSH_EMULATION_LOG"
PACING_ENV = "KVPUSH_EMULATION_PACING"  # "layers" (default), "every-layer" or "step"


def dilation_from_env() -> float:
    raw = os.environ.get(DILATION_ENV, "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{DILATION_ENV}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{DILATION_ENV} must be positive, got {raw!r}")
    return value


def pacing_from_env() -> str:
    pacing = os.environ.get(PACING_ENV, "layers")
    if pacing not in PACINGS:
        raise ValueError(f"{PACING_ENV}={pacing!r}: use one of {', '.join(PACINGS)}")
    return pacing


def emulated_deployment(config, architecture: str) -> Deployment:
    """The deployment a model folder emulates: ``KVPUSH_EMULATION_TARGET``, else its
    config.json's ``kvpush_emulation.target``; the folder must have its layer count."""
    settings = getattr(config, "kvpush_emulation", None) or {}
    target = os.environ.get(TARGET_ENV) or settings.get("target")
    if not target:
        raise ValueError(f"{architecture} needs a target: config.json's kvpush_emulation.target or {TARGET_ENV}")
    deployment = catalog.deployment(target)
    if config.num_hidden_layers != deployment.model.layers:
        raise ValueError(f"{architecture}: the folder has {config.num_hidden_layers} layers, "
                         f"{deployment.model.name} has {deployment.model.layers}")
    return deployment


def batch_of_this_step() -> list[Request] | None:
    """The step's requests from vLLM's attention metadata; ``None`` for a dummy run (warm-up,
    memory profiling), which has none and is not paced."""
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, list):  # micro-batches: take the first
        metadata = metadata[0] if metadata else None
    if isinstance(metadata, dict):  # one entry per attention layer, all alike for this model
        metadata = next(iter(metadata.values()), None)
    if metadata is None:
        return None
    starts = metadata.query_start_loc.tolist()
    contexts = metadata.seq_lens.tolist()
    real_tokens = int(metadata.num_actual_tokens)
    batch = []
    for index, context in enumerate(contexts):
        if index + 1 >= len(starts) or starts[index] >= real_tokens:
            break  # padding
        new = min(starts[index + 1], real_tokens) - starts[index]
        if new > 0:
            batch.append(Request(int(new), int(context)))
    return batch


class TimedLayer(nn.Module):
    """One layer of the tiny network: attention only (a pre-norm, QKV, rotary, vLLM's
    Attention, which writes the KV cache and calls the connector's per-layer hooks, then the
    output projection, added to the residual). No MLP: on a CPU every op costs its
    dispatch, and the layer count is the named model's, so each op left out is 64 fewer per
    step of work that is not the emulated GPU's."""

    def __init__(self, config, cache_config, prefix: str):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.qkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.out = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings,
                                   rope_parameters=config.rope_parameters)
        self.attn = Attention(self.heads, self.head_dim, self.head_dim ** -0.5, num_kv_heads=self.kv_heads,
                              cache_config=cache_config, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(hidden)).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return hidden + self.out(self.attn(q, k, v))


class KvpushTimedForCausalLM(nn.Module):
    """The model vLLM loads. Its weights are the folder's Qwen2 checkpoint (embeddings, the
    attention projections and their norms, the final norm and the LM head; the MLP weights are
    not used)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.deployment = emulated_deployment(config, ARCHITECTURE)
        self.dilation = dilation_from_env()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TimedLayer(config, vllm_config.cache_config, prefix=f"{prefix}layers.{index}")
            for index in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._pacing = pacing_from_env()
        self._pacer = LayerPacer(len(self.layers), clock=time.perf_counter, sleep=time.sleep)
        self._log_path = os.environ.get(LOG_ENV)
        self._log_lock = threading.Lock()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_kwargs):
        batch = batch_of_this_step()
        modeled = step_time(self.deployment, batch).seconds if batch else 0.0
        self._pacer.begin(modeled * self.dilation, by_layer=bool(batch) and paced_by_layer(self._pacing, batch))
        try:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed(input_ids)
            for index, layer in enumerate(self.layers):
                hidden = layer(positions, hidden)
                self._pacer.after_layer(index)
            return self.norm(hidden)
        finally:
            record = self._pacer.end()
            if batch and record is not None and self._log_path:
                with self._log_lock:
                    log_forward(self._log_path, self.dilation, batch, modeled, record)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if name == "model.embed_tokens.weight":
                target = "embed.weight"
            elif name == "model.norm.weight":
                target = "norm.weight"
            elif name == "lm_head.weight":
                target = "lm_head.weight"
            elif name.startswith("model.layers.") and name.endswith(".input_layernorm.weight"):
                target = f"layers.{int(name.split('.')[2])}.norm.weight"
            elif name.startswith("model.layers.") and ".self_attn." in name:
                index = int(name.split(".")[2])
                part = name.split(".self_attn.")[1]  # q_proj.weight, k_proj.bias, o_proj.weight, ...
                if part == "o_proj.weight":
                    target = f"layers.{index}.out.weight"
                else:
                    pending.setdefault(index, {})[part] = tensor
                    continue
            else:
                continue  # the MLP and the layer norms: not part of the tiny network
            with torch.no_grad():
                params[target].copy_(tensor)
            loaded.add(target)
        for index, parts in pending.items():
            for kind in ("weight", "bias"):
                joined = torch.cat([parts[f"{p}_proj.{kind}"] for p in "qkv"], dim=0)
                with torch.no_grad():
                    params[f"layers.{index}.qkv.{kind}"].copy_(joined)
                loaded.add(f"layers.{index}.qkv.{kind}")
        return loaded


def log_forward(path: str, dilation: float, batch, modeled: float, record, **extra) -> None:
    """One paced forward, one JSON line (the bench's CPU share reads them): its batch, the
    modeled and target seconds, its wall and busy seconds, the cores it may run on, and
    ``extra`` (an asynchronous forward's launch and the connector's marks)."""
    line = json.dumps({**extra,
        "pid": os.getpid(), "at": time.time(), "dilation": dilation,
        "batch": [[r.new, r.context] for r in batch],
        "modeled_s": modeled, "target_s": record.target_s,
        "wall_s": record.wall_s, "busy_s": record.busy_s, "cpu_s": record.cpu_s,
        "cores": sorted(os.sched_getaffinity(0)),  # where this forward's thread may run
    })
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")
