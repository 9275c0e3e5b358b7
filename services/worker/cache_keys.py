"""vLLM's KV cache events, keyed the way schedulers look prompts up (``kvpush.shared.block_keys``).

vLLM names a cached block by its own hash, seeded per engine; a ``BlockStored`` event
carries the blocks' hashes, their parent's hash and their tokens. ``CacheKeys`` keeps
vLLM hash -> our key for every block the engine holds, so a stored block's key can be
made from its parent's, and an evicted one's looked up. Bounded by the engine's cache:
every block vLLM stores it later reports removed (or clears them all).

A block whose key would need more than tokens (a LoRA, multimodal input, a cache salt:
``extra_keys``), or whose parent was stored before we listened, gets no key: the
scheduler then sees less than the engine holds, which costs speed, never correctness.

Pure: duck-typed events, no vLLM, no NATS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpush.shared.block_keys import leading_held, next_key


@dataclass
class CacheChanges:
    """The net effect of a batch: ``cleared`` (everything dropped) first, then ``removed``
    and ``stored`` (keys, in order), which never share a key, so the order they are
    applied in is moot."""

    stored: dict[bytes, None] = field(default_factory=dict)
    removed: dict[bytes, None] = field(default_factory=dict)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)

    def store(self, key: bytes) -> None:
        self.removed.pop(key, None)
        self.stored[key] = None

    def remove(self, key: bytes) -> None:
        self.stored.pop(key, None)
        self.removed[key] = None


class CacheKeys:
    """``block_size``: the engine's, which the scheduler keys prompts by (its heartbeat's)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._keys: dict[object, bytes] = {}  # vLLM's block hash -> our key

    def __len__(self) -> int:
        return len(self._keys)

    def held_blocks(self, keys: list[bytes]) -> int:
        """How many of a prompt's first blocks (``block_keys``) the engine holds, as far as
        its events have told us."""
        return leading_held(keys, set(self._keys.values()))

    def apply(self, events) -> CacheChanges:
        """What a batch of events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
        in order) changed, by our keys."""
        changes = CacheChanges()
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored":
                self._stored(event, changes)
            elif kind == "BlockRemoved":
                if getattr(event, "group_idx", None) not in (None, 0):
                    continue
                for block_hash in event.block_hashes:
                    key = self._keys.pop(block_hash, None)
                    if key is not None:
                        changes.remove(key)
            elif kind == "AllBlocksCleared":
                self._keys.clear()
                changes.stored.clear()
                changes.removed.clear()
                changes.cleared = True
        return changes

    def _stored(self, event, changes: CacheChanges) -> None:
        if getattr(event, "group_idx", None) not in (None, 0) or getattr(event, "lora_name", None):
            return  # another KV cache group, or a LoRA's: keyed by more than tokens
        if getattr(event, "medium", None) not in (None, "GPU"):
            return  # an offloading tier's copy, not the engine's own cache
        parent = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(event.parent_block_hash)
            if parent is None:
                return  # its prefix was stored before we listened: unknown
        if event.block_size != self.block_size:
            return  # keyed at another granularity than the scheduler's
        extra = getattr(event, "extra_keys", None) or []
        size = self.block_size
        for index, block_hash in enumerate(event.block_hashes):
            if index < len(extra) and extra[index] is not None:
                return  # this block and every one after it are keyed by more than tokens
            tokens = event.token_ids[index * size:(index + 1) * size]
            if len(tokens) != size:
                return
            parent = next_key(parent, tokens)
            self._keys[block_hash] = parent
            changes.store(parent)
