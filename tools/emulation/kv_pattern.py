"""The stand-in forward's arithmetic (tools/emulation/stand_in.py), apart from vLLM: the KV
pattern a new token writes, and the next token as a function of the KV a step read.

The pattern of a token is ``(token id × 31 + position × 7) mod 1021 + layer`` in every element
of its key and value: small integers, exact in float32, so the sums a step reads, and thus its
tokens, are the same on any engine that holds the same KV, whatever the order of the adds.
Tokens are drawn from ``[FIRST_TOKEN, vocab)``, above the tokenizer's special ids.
"""

from __future__ import annotations

import torch

PATTERN_MODULUS = 1021  # a prime: the pattern's values stay small integers (exact in float32)
FIRST_TOKEN = 16  # sampled tokens start here: the tokenizer's special ids are below it


def token_pattern(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each new token's base value (float32, one per token): what every element of its key
    and value holds in layer 0; layer ``i`` adds ``i``."""
    return ((input_ids.long() * 31 + positions.long() * 7) % PATTERN_MODULUS).to(torch.float32)


def next_tokens(block_sums: torch.Tensor, last_ids: torch.Tensor, last_positions: torch.Tensor,
                vocab: int) -> torch.Tensor:
    """Each request's next token from the sum of the values its step read (one per block of
    its context, every layer), its last input token and that token's position."""
    mixed = block_sums.to(torch.int64) * 1_000_003 + last_ids.long() * 8191 + last_positions.long() * 131
    for shift, factor in ((16, 0x45D9F3B), (16, 0x45D9F3B), (16, 1)):  # an integer hash's rounds:
        mixed = ((mixed >> shift) ^ mixed) * factor % (1 << 31)  # every input bit reaches the low bits
    return FIRST_TOKEN + torch.remainder(mixed, vocab - FIRST_TOKEN)
