"""The stand-in forward: an emulated GPU step that costs the host almost nothing.

The timed network (:mod:`kvpush.tools.emulation.timed_model`) computes a tiny attention stack
for real, 8-18 ms of CPU per decode step at 64 layers, so its runs had to dilate time by
k = 75-175 and every real host cost (NATS, the scheduler, the connector, vLLM's step loop,
the proxies) was divided by k with it. The stand-in computes nothing. Per step:

- each layer writes a cheap deterministic pattern into the new tokens' KV slots (vLLM's own
  cache write, through the attention layer's backend), with the connector's per-layer hooks
  around it exactly where vLLM's attention calls them (``wait_for_layer_load`` before,
  ``save_kv_layer`` after);
- the device is asynchronous, as a GPU is (:mod:`kvpush.tools.emulation.device`): the forward
  returns once its host work is done, so vLLM runs the connector's ``wait_for_save`` and
  ``get_finished`` inside the modeled step, and ``compute_logits`` (sampling) waits for the
  step's modeled end. A WRITE a hook asks for leaves once its layer (or the step) would be
  computed: the connector's marks (``kvpush.connector.compute_marks``) are this device's;
- each layer then reads one value of every block of each request's context (the first key
  of the block's first token) and adds it to that request's sum. The sampled token is a
  function of that sum, the last input token and its position: **an output proves its KV
  arrived.** A block whose read value differs (a transfer that wrote elsewhere, or not at
  all, or flipped that value) changes the token; KV checksums cover every other byte.

The pattern and the token's arithmetic are :mod:`kvpush.tools.emulation.kv_pattern`'s.

What it does not model: anything of the real network's numerics. Use it for time, never as a
language model. vLLM loads it by its architecture name (``KvpushStandInForCausalLM``,
registered by :mod:`kvpush.tools.emulation.plugin`) from a folder ``kvpush model build
--profile stand-in-*`` writes; it reads the same settings from the environment as the timed
model (target, dilation, forward log; the pacing switch is the timed model's only).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group, is_v1_kv_transfer_group
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import get_attention_context

from kvpush.connector import compute_marks
from kvpush.tools.emulation.device import EmulatedDevice
from kvpush.tools.emulation.kv_pattern import next_tokens, token_pattern
from kvpush.tools.emulation.pacing import LayerPacer
from kvpush.tools.emulation.plugin import STAND_IN_ARCHITECTURE
from kvpush.tools.emulation.time_model import step_time
from kvpush.tools.emulation.timed_model import LOG_ENV, batch_of_this_step, dilation_from_env, \
    emulated_deployment, log_forward

class KvpushStandInForCausalLM(nn.Module):
    """The model vLLM loads: one vLLM ``Attention`` per layer, only so that vLLM allocates each
    layer's KV cache and its connector registers it; their forward never runs."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.deployment = emulated_deployment(config, STAND_IN_ARCHITECTURE)
        self.dilation = dilation_from_env()
        self.vocab = config.vocab_size
        self.hidden_size = config.hidden_size
        self.layers = nn.ModuleList(
            Attention(config.num_attention_heads, config.head_dim, config.head_dim ** -0.5,
                      num_kv_heads=config.num_key_value_heads, cache_config=vllm_config.cache_config,
                      prefix=f"{prefix}layers.{index}.attn")
            for index in range(config.num_hidden_layers))
        self.layer_names = [layer.layer_name for layer in self.layers]
        self._pacer = LayerPacer(len(self.layers), clock=time.perf_counter, sleep=time.sleep)
        self._device = EmulatedDevice(len(self.layers), clock=time.perf_counter)
        self._step: tuple[list, float] | None = None  # the running step's batch and modeled seconds
        compute_marks.install(self._device.mark)  # the connector in this process asks this device
        self._log_path = os.environ.get(LOG_ENV)
        self._log_lock = threading.Lock()
        self._cache_views: dict[str, _CacheViews] = {}
        self._layer_offsets = torch.arange(len(self.layers), dtype=torch.float32)  # layer i's pattern adds i

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden_size, dtype=torch.float32)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_kwargs):
        hidden = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=torch.float32)
        batch = batch_of_this_step()
        if not batch:
            return hidden  # a dummy run (warm-up, memory profiling): nothing to write or time
        modeled = step_time(self.deployment, batch).seconds
        self._pacer.begin(modeled * self.dilation, by_layer=False)
        self._device.begin(self._pacer.started_at, modeled * self.dilation)
        self._step = (batch, modeled)
        sums = self._layers(input_ids, positions, len(batch))
        metadata = get_attention_context(self.layer_names[0])[0]
        last = metadata.query_start_loc[1:len(batch) + 1].long() - 1
        hidden[last, 0] = next_tokens(sums, input_ids[last], positions[last], self.vocab).to(torch.float32)
        self._pacer.launched()  # the device runs on; the connector's hooks run now
        return hidden

    def _device_done(self) -> None:
        """Sampling: wait for the running step's modeled end, and log the step."""
        step, self._step = self._step, None
        if step is None:
            return
        self._pacer.wait_for_device()
        marks = self._device.marks
        self._device.end()
        record = self._pacer.end()
        if record is not None and self._log_path:
            batch, modeled = step
            with self._log_lock:
                log_forward(self._log_path, self.dilation, batch, modeled, record, launch_s=record.launch_s,
                            marks=[[layer, round(at, 6)] for layer, at in marks])

    def _layers(self, input_ids: torch.Tensor, positions: torch.Tensor, requests: int) -> torch.Tensor:
        """Write every layer's KV for the new tokens and read one value per context block;
        returns each request's sum of what it read. Per layer: vLLM's cache write, one gather
        into that layer's row of ``read``, and the connector's two hooks; the layers' patterns
        are made in one add before, their reads summed in one sum after (each op costs the
        host 5-10 µs whatever its size: 80 layers made it 4 ops a layer, now 2)."""
        connector = get_kv_transfer_group() if has_kv_transfer_group() and is_v1_kv_transfer_group() else None
        metadata, first, kv_cache, slots = get_attention_context(self.layer_names[0])
        hooked = connector is not None and metadata is not None and connector.has_connector_metadata()
        width = first.num_kv_heads * first.head_size
        layers = len(self.layers)
        # Layer i's pattern is the tokens' pattern plus i: every layer's, in one add.
        patterns = (token_pattern(input_ids, positions).unsqueeze(0) + self._layer_offsets.unsqueeze(1))
        patterns = patterns.unsqueeze(2).expand(-1, -1, width).contiguous().view(  # vLLM's write wants it dense
            layers, -1, first.num_kv_heads, first.head_size)
        slots = metadata.slot_mapping if slots is None else slots
        tables = metadata.block_table[:requests].long()
        flat_tables = tables.reshape(-1)
        blocks_used = (metadata.seq_lens[:requests].long() + kv_cache.shape[2] - 1) // kv_cache.shape[2]
        used = torch.arange(tables.shape[1]).unsqueeze(0) < blocks_used.unsqueeze(1)
        read = torch.empty(layers, flat_tables.numel(), dtype=torch.float32)
        for index, (name, layer) in enumerate(zip(self.layer_names, self.layers)):
            if hooked:
                connector.wait_for_layer_load(name)
            views = self._views(layer)
            views.write(patterns[index], slots)
            if hooked:
                connector.save_kv_layer(name, layer.kv_cache, metadata)
            torch.index_select(views.firsts, 0, flat_tables, out=read[index])
        return (read.sum(dim=0).view(tables.shape) * used).sum(dim=1)

    def _views(self, layer: Attention) -> "_CacheViews":
        """The layer's cache views, made again only when vLLM hands the layer another tensor."""
        cache = layer.kv_cache
        views = self._cache_views.get(layer.layer_name)
        if views is None or views.cache is not cache:
            views = self._cache_views[layer.layer_name] = _CacheViews(layer, cache)
        return views

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self._device_done()
        logits = torch.zeros(hidden.shape[0], self.vocab, dtype=torch.float32)
        # Greedy takes it; sampled at any sane temperature, every other token is e^-100 as likely.
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long().clamp(0, self.vocab - 1)] = 100.0
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:  # the folder's Qwen2 weights: read, and none used
            pass
        return {name for name, _ in self.named_parameters()}


class _CacheViews:
    """One layer's KV cache as the stand-in touches it: vLLM's CPU layout ``[blocks, kv heads,
    block size, 2 × head size]`` (keys, then values, in the last dimension), its key and value
    halves for vLLM's cache write, and each block's first key element (head 0, token 0)."""

    def __init__(self, layer: Attention, cache: torch.Tensor):
        from vllm import _custom_ops as ops

        self.cache = cache
        blocks, heads, block_size, _ = cache.shape
        self.key_cache, self.value_cache = cache.view(blocks, heads, block_size * 2, -1).chunk(2, dim=2)
        self.firsts = cache.view(blocks, -1)[:, 0]
        self._op, self._layer = ops.cpu_attn_reshape_and_cache, layer

    def write(self, kv: torch.Tensor, slots: torch.Tensor) -> None:
        layer = self._layer
        self._op(kv, kv, self.key_cache, self.value_cache, slots, layer.isa, k_scale=layer._k_scale_float,
                 v_scale=layer._v_scale_float, kv_cache_dtype=layer.impl.kv_cache_dtype)
