"""The emulated GPUs' time model and catalog (tools/emulation): pure arithmetic, checked against
numbers worked by hand from the cited datasheets."""

from __future__ import annotations

import dataclasses

import pytest

from kvpush.services.launch.model import PROFILES
from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.plugin import ARCHITECTURE, STAND_IN_ARCHITECTURE
from kvpush.tools.emulation.time_model import (Request, decode_step_seconds, prefill_seconds, shaped_link_rate,
                                               step_time, transfer_to_prefill_ratio)

QWEN = catalog.deployment("qwen3-32b@p5en")
LLAMA = catalog.deployment("llama-3.1-8b@h100")


def test_kv_bytes_per_token_are_the_models_own():
    assert catalog.QWEN3_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144
    assert catalog.LLAMA_31_8B.kv_bytes_per_token == 131_072


def test_a_single_decode_step_is_memory_bound_and_reads_the_weights_once():
    step = step_time(LLAMA, [Request(1, 1000)])
    assert step.bound == "memory"
    weights_s = 8_030_261_248 * 2 / (3.35e12 * 0.60)  # bf16 weights over H100's HBM at 60%
    kv_s = 1000 * 131_072 / (3.35e12 * 0.60)
    assert step.memory_s == pytest.approx(weights_s + kv_s, rel=1e-3)
    assert step.allreduce_s == 0  # TP 1
    assert step.seconds == pytest.approx(step.memory_s + 0.001, rel=1e-9)


def test_a_long_prefill_is_compute_bound_and_grows_faster_than_its_tokens():
    step = step_time(QWEN, [Request(8192, 8192)])
    assert step.bound == "compute"
    assert step.allreduce_s > 0  # TP 8
    linear_flops = 2 * 32_762_123_264 * 8192
    assert step.compute_s > linear_flops / (8 * 989.5e12 * 0.48)  # attention adds to it
    assert prefill_seconds(QWEN, 16384) > 2 * prefill_seconds(QWEN, 8192)


def test_a_chunk_over_a_prefix_costs_what_the_prefix_adds_to_attention():
    alone = step_time(QWEN, [Request(1024, 1024)])
    after_prefix = step_time(QWEN, [Request(1024, 5120)])
    assert after_prefix.compute_s > alone.compute_s
    extra_attention = 4 * 64 * 64 * 128 * 1024 * 4096  # each new token also attends to 4096 more
    assert after_prefix.compute_s - alone.compute_s == pytest.approx(extra_attention / (8 * 989.5e12 * 0.48))


def test_batching_decodes_shares_the_weight_reads():
    one = decode_step_seconds(QWEN, [2048])
    sixteen = decode_step_seconds(QWEN, [2048] * 16)
    assert one < sixteen < 2 * one


def test_an_empty_step_takes_no_time_and_bad_requests_are_refused():
    assert step_time(QWEN, []).seconds == 0
    with pytest.raises(ValueError):
        Request(5, 4)
    with pytest.raises(ValueError):
        Request(-1, 4)


def test_the_shaped_link_keeps_the_transfer_to_prefill_ratio_at_every_length():
    tiny_kv = PROFILES["timed-qwen3-32b"]
    tiny_bytes = 2 * tiny_kv.num_layers * tiny_kv.num_kv_heads * tiny_kv.head_dim * 4  # float32
    k = 25.0
    rate = shaped_link_rate(QWEN, tiny_bytes, k)
    for tokens in (1024, 4096, 8192, 16384):
        emulated = (tokens * tiny_bytes / rate) / (prefill_seconds(QWEN, tokens) * k)
        assert emulated == pytest.approx(transfer_to_prefill_ratio(QWEN, tokens))
    with pytest.raises(ValueError):
        shaped_link_rate(QWEN, tiny_bytes, 0)


def test_every_timed_profile_matches_its_deployment_and_names_the_plugins_architecture():
    timed = {name: p for name, p in PROFILES.items() if p.emulates}
    assert set(timed) == {"timed-qwen3-32b", "timed-llama-3.1-8b", "stand-in-qwen3-32b", "stand-in-llama-3.3-70b"}
    for name, profile in timed.items():
        assert profile.architecture == (ARCHITECTURE if name.startswith("timed-") else STAND_IN_ARCHITECTURE)
        assert profile.num_layers == catalog.deployment(profile.emulates).model.layers
        assert profile.head_dim * profile.num_heads <= profile.hidden_size


def test_an_unknown_deployment_is_a_clear_error():
    with pytest.raises(ValueError, match="known: llama-3.1-8b@h100, llama-3.3-70b@p5en, qwen3-32b@p5en"):
        catalog.deployment("gpt-5@tpu")


def test_a_faster_gpu_is_faster_and_more_bandwidth_shortens_decode_only():
    on_h200 = dataclasses.replace(LLAMA, gpu=catalog.H200)
    assert decode_step_seconds(on_h200, [1000]) < decode_step_seconds(LLAMA, [1000])
    # Same dense FLOP/s on both: a compute-bound prefill takes the same time.
    assert prefill_seconds(on_h200, 8192) == pytest.approx(prefill_seconds(LLAMA, 8192))


def test_where_fetching_a_prefix_stops_paying():
    """At the break-even link rate reading the prefix takes as long as computing it again;
    the shortest prefix worth fetching is, and one block less is not; a fixed cost longer
    than the whole recompute never pays."""
    from kvpush.tools.emulation import catalog
    from kvpush.tools.emulation.time_model import (fetch_break_even_link, fetch_break_even_tokens, fetch_seconds,
                                                   recompute_seconds)

    deployment = catalog.deployment("llama-3.1-8b@h100")
    recompute = recompute_seconds(deployment, 4096, 256)
    assert 0 < recompute < prefill_seconds(deployment, 4096 + 256)
    link = fetch_break_even_link(deployment, 4096, 256, fixed_s=0.01)
    assert fetch_seconds(deployment, 4096, 0.01, link) == pytest.approx(recompute)
    assert fetch_seconds(deployment, 4096, 0.01, link * 2) < recompute < fetch_seconds(deployment, 4096, 0.01, link / 2)
    tokens = fetch_break_even_tokens(deployment, 256, fixed_s=0.02)
    assert tokens % 16 == 0
    assert fetch_seconds(deployment, tokens, 0.02) < recompute_seconds(deployment, tokens, 256)
    assert fetch_seconds(deployment, tokens - 16, 0.02) >= recompute_seconds(deployment, tokens - 16, 256)
    assert fetch_break_even_link(deployment, 1024, 256, fixed_s=10.0) is None
    assert fetch_break_even_tokens(deployment, 256, fixed_s=10.0, limit=4096) is None
