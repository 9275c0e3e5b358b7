"""KV tensors laid out as vLLM 0.32 lays them on GPUs, and the patterns that check them.

Each layer's KV is a view of shape (blocks, block tokens, KV heads, 2 x head dim): K and
V packed in the last dimension. All layers share one allocation, whose physical order is a
``KVCacheLayout`` permutation: ``LBNHC`` (vLLM's default), ``LBHNC`` (heads before tokens,
as FlashInfer's HND orders; SM100 only in vLLM, here to exercise the permuted view) and
``BLNHC`` (blocks outermost: a block of every layer together). The per-layer shape is
Qwen3-32B's (8 KV heads of 128, bf16) at vLLM's GPU block size of 16 tokens: 64 KiB a
block a layer.

A pattern gives every 16-bit word of a (layer, block) a value from a seed, the layer, the
block and the word's place in the block's memory: whatever was copied where, the bytes
say where they came from. Pure torch; no NIXL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("LBNHC", "LBHNC", "BLNHC")
BLOCK_TOKENS = 16  # vLLM's block size on GPUs
KV_HEADS = 8  # Qwen3-32B
HEAD_DIM = 128
PACKED = 2 * HEAD_DIM  # K and V in the last dimension
WORDS_PER_BLOCK = BLOCK_TOKENS * KV_HEADS * PACKED  # bf16: 16-bit words
BLOCK_BYTES = 2 * WORDS_PER_BLOCK  # 64 KiB a block a layer


@dataclass
class Pool:
    """One process's KV: the allocation and each layer's view (vLLM's ``kv_caches``)."""

    layout: str
    base: torch.Tensor
    views: dict[str, torch.Tensor]
    layers: int
    blocks: int

    @property
    def words(self) -> torch.Tensor:
        """The whole allocation as 16-bit words, in memory order."""
        return self.base.view(torch.int16).view(-1)

    def offsets(self, layer: int) -> torch.Tensor:
        """The first word of each block of ``layer`` in ``words``."""
        view = self.views[layer_name(layer)]
        element = view.element_size()
        start = (view.data_ptr() - self.base.data_ptr()) // element
        return start + torch.arange(self.blocks, device=self.base.device, dtype=torch.int64) * view.stride(0)


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def allocate(layout: str, layers: int, blocks: int, device: str | torch.device) -> Pool:
    """A pool of ``blocks`` blocks over ``layers`` layers in ``layout``; each layer's view is
    (blocks, tokens, heads, packed) whatever the physical order."""
    if layout == "LBNHC":
        base = torch.empty((layers, blocks, BLOCK_TOKENS, KV_HEADS, PACKED), dtype=torch.bfloat16, device=device)
        views = [base[layer] for layer in range(layers)]
    elif layout == "LBHNC":
        base = torch.empty((layers, blocks, KV_HEADS, BLOCK_TOKENS, PACKED), dtype=torch.bfloat16, device=device)
        views = [base[layer].permute(0, 2, 1, 3) for layer in range(layers)]
    elif layout == "BLNHC":
        base = torch.empty((blocks, layers, BLOCK_TOKENS, KV_HEADS, PACKED), dtype=torch.bfloat16, device=device)
        views = [base[:, layer] for layer in range(layers)]
    else:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    if blocks in (BLOCK_TOKENS, KV_HEADS, PACKED, layers):
        raise ValueError(f"{blocks} blocks: the block dimension must differ in size from the others")
    return Pool(layout, base, {layer_name(i): view for i, view in enumerate(views)}, layers, blocks)


def pattern(seed: int, layer: int, blocks: torch.Tensor) -> torch.Tensor:
    """The words of each of ``blocks`` of ``layer`` under ``seed``: (len(blocks), words)."""
    word = torch.arange(WORDS_PER_BLOCK, device=blocks.device, dtype=torch.int64)
    mixed = (word[None, :] * 40503 + blocks[:, None] * 2654435761 + layer * 97 + seed * 1_000_003) >> 3
    return (mixed & 0xFFFF).to(torch.int32).to(torch.int16)  # wraps into the signed 16-bit range


def fill(pool: Pool, seed: int) -> None:
    """Every block of every layer gets its pattern under ``seed``."""
    words = pool.words
    every = torch.arange(pool.blocks, device=pool.base.device, dtype=torch.int64)
    span = torch.arange(WORDS_PER_BLOCK, device=pool.base.device, dtype=torch.int64)
    for layer in range(pool.layers):
        index = pool.offsets(layer)[:, None] + span[None, :]
        words[index.view(-1)] = pattern(seed, layer, every).view(-1)


def mismatches(pool: Pool, seed: int, copied: dict[int, tuple[int, int]]) -> int:
    """Words of the whole pool that differ from what they should hold: block ``b`` of each
    layer in ``copied`` holds (source seed, source block)'s pattern, every other block its
    own under ``seed``. 0: every byte is right."""
    words = pool.words
    device = pool.base.device
    span = torch.arange(WORDS_PER_BLOCK, device=device, dtype=torch.int64)
    wrong = 0
    for layer in range(pool.layers):
        index = pool.offsets(layer)[:, None] + span[None, :]
        expected = pattern(seed, layer, torch.arange(pool.blocks, device=device, dtype=torch.int64))
        for block, (source_seed, source_block) in copied.items():
            expected[block] = pattern(source_seed, layer, torch.tensor([source_block], device=device))[0]
        wrong += int((words[index.view(-1)].view(pool.blocks, -1) != expected).sum())
    return wrong
