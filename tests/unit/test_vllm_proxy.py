"""The proxies in front of `vllm serve` (tools/bench/vllm_proxy.py) build each leg as
vLLM's examples do."""

from __future__ import annotations

import argparse

import pytest

from kvpush.tools.bench.vllm_proxy import Instance, parse_args, prefill_leg, push_decode_leg


def test_the_prefill_leg_asks_for_one_token_without_streaming_and_for_remote_decode():
    body = {"model": "m", "prompt": "hi", "max_tokens": 128, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 4, "ignore_eos": True}
    leg = prefill_leg(body)
    assert leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 128 and body["stream"] is True, "the decode leg keeps the client's body"


def test_the_push_decode_leg_carries_only_the_prefills_coordinates():
    prefill = Instance.parse("127.0.0.1:8100:prefill-0:5600")
    leg = push_decode_leg({"prompt": "hi", "max_tokens": 8}, prefill, "/completions", "abc")
    params = leg["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == ("prefill-0", "127.0.0.1",
                                                                                           5600)
    assert params["remote_request_id"] == "cmpl-abc-0"
    assert "remote_block_ids" not in params
    assert push_decode_leg({}, prefill, "/chat/completions", "abc")["kv_transfer_params"][
        "remote_request_id"] == "chatcmpl-abc-0"


def test_an_instance_is_host_port_or_host_port_engine_side_channel():
    assert Instance.parse("h:1") == Instance("h", 1)
    with pytest.raises(argparse.ArgumentTypeError):
        Instance.parse("h:1:e")


def test_the_push_decode_leg_names_the_prefills_tp_as_the_proxy_was_told():
    args = parse_args(["--flow", "push", "--prefill", "127.0.0.1:8100:prefill-0:5600", "--decode", "127.0.0.1:8200",
                       "--prefill-tp", "2"])
    (prefill,) = args.prefill
    assert prefill == Instance("127.0.0.1", 8100, "prefill-0", 5600, tp_size=2)
    assert push_decode_leg({}, prefill, "/completions", "abc")["kv_transfer_params"]["tp_size"] == 2
    (plain,) = parse_args(["--flow", "pull", "--prefill", "h:1", "--decode", "h:2"]).prefill
    assert plain.tp_size == 1
