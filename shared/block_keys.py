"""The key of a whole block of prompt tokens in a worker's prefix cache, the same in
every process: a worker relays what its engine caches by these keys
(``kvpush.services.worker.cache_keys``), and a scheduler looks a prompt's keys up
(``kvpush.services.scheduler.prefixes``).

Like vLLM's own block hash, a block's key covers every token before it: it is made
from its parent's key and its own tokens, so a worker can key the blocks vLLM reports
one step at a time. vLLM's hashes themselves cannot be used: they are seeded per
engine (``PYTHONHASHSEED``) and change with its hash setting.

Pure: no NATS, no vLLM.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Container, Sequence

KEY_BYTES = 16


def next_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The key of a block holding ``tokens``, after the block keyed ``parent`` (None: the first)."""
    digest = hashlib.blake2b(parent or b"", digest_size=KEY_BYTES)
    digest.update(array.array("q", tokens).tobytes())
    return digest.digest()


def block_keys(token_ids: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """One key per whole block of ``token_ids`` (a partial last block has none)."""
    keys = []
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = next_key(parent, token_ids[end - block_size:end])
        keys.append(parent)
    return keys


def leading_held(keys: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of a prompt's first blocks (its ``block_keys``, in order) are in ``held``:
    a prefix cache holds a block only with every block before it."""
    count = 0
    for key in keys:
        if key not in held:
            break
        count += 1
    return count
