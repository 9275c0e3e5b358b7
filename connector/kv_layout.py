"""vLLM's per-layer KV tensors -> registered memory regions and per-block regions.

Each layer's tensor has one dimension of size ``num_blocks``; every index of the
dimensions before it (e.g. K/V on GPU layouts) is its own region of blocks. Blocks
are treated as opaque bytes between identically configured engines.

Between engines at different tensor-parallel sizes a copy moves some KV heads of each
block (``block_ranges.HeadSlice``). That needs a block's heads outermost in its memory,
each one contiguous run of bytes: vLLM's CPU layout ``[blocks, heads, block size,
2 * head size]`` is so. ``describe`` takes the dimension right after the blocks' as the
heads' when it has the rank's head count and lies outermost (``KvLayout.heads``; 0 when
not, and then blocks move only whole: an engine whose block size equals its head count
on a layout with tokens outermost would be misread, which no CPU engine has).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpush.connector.block_ranges import HeadSlice, part_of
from kvpush.shared.wire import AgentInfo, KvRegion


@dataclass(frozen=True)
class KvLayout:
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    num_blocks: int
    regions: list[KvRegion]
    buffers: list[tuple[int, int]]  # distinct (addr, length) to register with NIXL
    # Each layer's regions, in layer order: (layer name, first region, end), as regions[first:end].
    layers: list[tuple[str, int, int]] = field(default_factory=list)
    heads: int = 0  # KV heads in each block, outermost in its memory (0: not known, or not outermost)

    @property
    def block_bytes(self) -> int:
        """The bytes of one block in every region: what this rank holds of a block, all layers."""
        return sum(region.block_len for region in self.regions)

    def layer_index(self, name: str) -> int | None:
        """The position of the layer vLLM calls ``name``, or None."""
        for index, (layer, _, _) in enumerate(self.layers):
            if layer == name:
                return index
        return None


def describe(kv_caches: dict[str, torch.Tensor], num_blocks: int, heads: int = 0) -> KvLayout:
    """``heads``: the KV heads this rank holds (0: not known)."""
    regions: list[KvRegion] = []
    outermost = heads > 0
    layers: list[tuple[str, int, int]] = []
    buffers: dict[int, int] = {}
    device = None
    for name in sorted(kv_caches, key=_layer_order):
        tensor = kv_caches[name]
        device = tensor.device
        try:
            block_dim = list(tensor.shape).index(num_blocks)
        except ValueError:
            raise ValueError(
                f"layer {name}: no dimension of size num_blocks={num_blocks} in {tuple(tensor.shape)}"
            ) from None
        elem = tensor.element_size()
        block_stride = tensor.stride(block_dim) * elem
        block_len = elem
        for size in tensor.shape[block_dim + 1 :]:
            block_len *= size
        if not _dense(tensor[(0,) * (block_dim + 1)]):
            raise ValueError(f"layer {name}: a block is not contiguous in memory")
        outermost = outermost and _heads_outermost(tensor, block_dim, heads, block_len)
        leading = tensor.shape[:block_dim]
        first = len(regions)
        for flat in range(_prod(leading)):
            index, rest = [], flat
            for size in reversed(leading):
                index.append(rest % size)
                rest //= size
            index.reverse()
            offset = sum(i * tensor.stride(d) for d, i in enumerate(index)) * elem
            regions.append(KvRegion(tensor.data_ptr() + offset, block_stride, block_len))
        layers.append((name, first, len(regions)))
        storage = tensor.untyped_storage()
        buffers[storage.data_ptr()] = max(buffers.get(storage.data_ptr(), 0), storage.nbytes())
    if device is None:
        raise ValueError("no KV cache tensors to register")
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"
    return KvLayout(
        mem_type=mem_type,
        device_id=device.index or 0,
        num_blocks=num_blocks,
        regions=regions,
        buffers=_merge(buffers),
        layers=layers,
        heads=heads if outermost else 0,
    )


def _heads_outermost(tensor: torch.Tensor, block_dim: int, heads: int, block_len: int) -> bool:
    """The dimension after the blocks' holds ``heads`` heads, each a contiguous run of the block."""
    dim = block_dim + 1
    return (dim < tensor.dim() and tensor.shape[dim] == heads
            and tensor.stride(dim) * tensor.element_size() * heads == block_len)


def compatible(local: list[KvRegion], remote: list[KvRegion], local_part: HeadSlice | None = None,
               remote_part: HeadSlice | None = None) -> str | None:
    """None when blocks (``local_part`` of ours and ``remote_part`` of the remote's, each
    None for whole blocks) can be copied region by region, else why not."""
    if len(local) != len(remote):
        return f"{len(local)} local KV regions but {len(remote)} remote"
    for i, (a, b) in enumerate(zip(local, remote)):
        try:
            here, there = part_of(a.block_len, local_part)[1], part_of(b.block_len, remote_part)[1]
        except ValueError as exc:
            return f"region {i}: {exc}"
        if here != there and local_part is None and remote_part is None:
            return f"region {i}: block is {a.block_len} bytes here, {b.block_len} remote"
        if here != there:
            return f"region {i}: {here} bytes of each block here, {there} of each remote block"
    return None


def copy_problem(layout: KvLayout, remote: AgentInfo, local_blocks: list[int], remote_blocks: list[int],
                 local_part: HeadSlice | None = None, remote_part: HeadSlice | None = None) -> str | None:
    """Why these blocks (``local_part`` and ``remote_part`` of each, None: whole) cannot
    be copied between our ``layout`` and ``remote``'s, or None."""
    problem = compatible(layout.regions, remote.regions, local_part, remote_part)
    if problem is None and local_part is not None and layout.heads != local_part.of:
        problem = f"our blocks do not hold their {local_part.of} heads outermost: they move only whole"
    if problem is None and remote_part is not None and remote.heads != remote_part.of:
        problem = f"the remote's blocks do not hold their {remote_part.of} heads outermost: they move only whole"
    if problem is None and len(local_blocks) != len(remote_blocks):
        problem = f"{len(remote_blocks)} remote blocks for {len(local_blocks)} local ones"
    if problem is None and any(not 0 <= b < remote.num_blocks for b in remote_blocks):
        problem = f"remote block ids outside 0..{remote.num_blocks - 1}"
    if problem is None and any(not 0 <= b < layout.num_blocks for b in local_blocks):
        problem = f"local block ids outside 0..{layout.num_blocks - 1}"
    return problem


def _dense(block: torch.Tensor) -> bool:
    """The block's elements fill one range of memory with no gap, in whatever order its
    dimensions lie (a ``KVCacheLayout`` permutation: LBHNC's view is (N, H, C) over (H, N, C)
    memory). Its bytes are then copied as they lie: both engines use the same layout."""
    dims = sorted((stride, size) for stride, size in zip(block.stride(), block.shape) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _merge(buffers: dict[int, int]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for addr, length in sorted(buffers.items()):
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            start, old = merged[-1]
            merged[-1] = (start, max(old, addr + length - start))
        else:
            merged.append((addr, length))
    return merged


def _prod(sizes) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def _layer_order(name: str):
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return ([int(d) for d in digits], name)
