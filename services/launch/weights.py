"""The built-in model's network: a Qwen2 configuration for a profile's shape, and its
weights, random but seeded (the same seed gives the same bytes on any machine).
``kvpush.services.launch.model`` builds the model folder with them.
"""

from __future__ import annotations

import hashlib

from kvpush.services.launch.profiles import ModelProfile

#: Standard deviation used to re-initialise every 2-D weight. With the
#: transformers default (0.02) the model emits one token over and over; 0.1
#: makes the continuation depend on the whole context.
INIT_STD = 0.1

ROPE_THETA = 10000.0


def qwen2_config(prof: ModelProfile, eos_id: int):
    """transformers' ``Qwen2Config`` of the profile's shape, in float32, EOS for BOS and
    padding too; a timed profile's names the deployment it emulates."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=prof.vocab_size,
        hidden_size=prof.hidden_size,
        intermediate_size=prof.intermediate_size,
        num_hidden_layers=prof.num_layers,
        num_attention_heads=prof.num_heads,
        num_key_value_heads=prof.num_kv_heads,
        head_dim=prof.head_dim,
        max_position_embeddings=prof.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
        architectures=[prof.architecture],
        **({"kvpush_emulation": {"target": prof.emulates}} if prof.emulates else {}),
    )


def random_model(config, eos_id: int, seed: int):
    """A ``Qwen2ForCausalLM`` of ``config`` whose 2-D weights are drawn from ``seed``; the
    caller's random state is left as it was."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    # Leave the caller's global RNG state as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    # Every 2-D weight (embeddings, projections, lm_head) is drawn from a
    # dedicated generator in name order, so the result does not depend on
    # how transformers initialises (or lazily skips initialising) weights.
    # 1-D parameters keep their constant defaults (norm weights 1, biases 0).
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _pname, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.dim() == 2:
                param.normal_(mean=0.0, std=INIT_STD, generator=gen)
    model.eval()

    model.generation_config = GenerationConfig(
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        do_sample=False,
    )
    return model


def weights_hash(state_dict) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for key in sorted(state_dict):
        t = state_dict[key].detach().contiguous().cpu()
        h.update(key.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
