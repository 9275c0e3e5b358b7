"""The built-in model's shapes: one ``ModelProfile`` per name (``kvpush model build
--profile``), from the small CPU model to the emulated-GPU timed ones."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelProfile:
    """Shape of a Qwen2 model to build."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    #: What vLLM loads it as. A timed profile names the emulated-GPU model
    #: (tools/emulation), which paces each forward to the time ``emulates`` (a deployment in
    #: tools/emulation/catalog.py) would take; the network itself is this Qwen2.
    architecture: str = "Qwen2ForCausalLM"
    emulates: str | None = None

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        """Bytes of K and V cache per token, all layers, in float32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _timed(num_layers: int, emulates: str, architecture: str = "KvpushTimedForCausalLM") -> ModelProfile:
    """Emulated GPUs (docs/benchmarks.md, "Emulated GPUs"): the named model's layer count at the
    narrowest width vLLM's CPU attention takes (head_dim 32, one KV head: 16 KiB of KV per
    token in float32), and context for a 16k prompt plus its outputs. ``architecture``: the
    timed network, or the stand-in forward (tools/emulation/stand_in.py), which computes
    nothing and reads the KV it was given."""
    return ModelProfile(
        hidden_size=64,
        num_layers=num_layers,
        num_heads=1,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=4096,
        max_position_embeddings=20480,
        architecture=architecture,
        emulates=emulates,
    )


PROFILES: dict[str, ModelProfile] = {
    "small": ModelProfile(
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=512,
        vocab_size=4096,
        max_position_embeddings=8192,  # room for 4k-8k token benchmarks
    ),
    "kv-heavy": ModelProfile(
        hidden_size=512,
        num_layers=4,
        num_heads=4,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=1024,
        vocab_size=4096,
        # A 16k prompt and its outputs. Memory would allow far more (16 KiB of KV per token:
        # the bench's 2 GiB per engine hold 131,072 tokens); time does not (docs/benchmarks.md).
        max_position_embeddings=20480,
    ),
    "timed-qwen3-32b": _timed(num_layers=64, emulates="qwen3-32b@p5en"),
    "timed-llama-3.1-8b": _timed(num_layers=32, emulates="llama-3.1-8b@h100"),
    "stand-in-qwen3-32b": _timed(num_layers=64, emulates="qwen3-32b@p5en", architecture="KvpushStandInForCausalLM"),
    "stand-in-llama-3.3-70b": _timed(num_layers=80, emulates="llama-3.3-70b@p5en",
                                     architecture="KvpushStandInForCausalLM"),
}

DEFAULT_PROFILE = "small"


def get_profile(profile: str) -> ModelProfile:
    """The profile of that name; ValueError naming the known ones if there is none."""
    try:
        return PROFILES[profile]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown model profile {profile!r} (known: {known})") from None
