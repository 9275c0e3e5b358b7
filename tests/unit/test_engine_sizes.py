"""An engine's sizes, on `kvpush worker`, `kvpush up` and `kvpush bench` (for kvpush's workers
and `vllm serve` alike): ``--block-size``, tokens per KV block, and ``--max-num-seqs``, requests
run at once. The issue-45 instrument sets 32, the smallest vLLM's
CPU attention takes, where GPUs use 16. The real CLI parses each command line; vLLM's own
config builder reads the engine arguments. Nothing is started."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.usage.usage_lib import UsageContext

from kvpush.services.cli.main import build_parser
from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.services.launch.stack import Stack
from kvpush.services.worker import engine
from kvpush.services.worker.engine_settings import EngineSettings, block_size_problem
from kvpush.tools.bench.systems import KvpushSystem, Topology, VllmServeSystem


def test_up_passes_its_block_size_to_every_worker_and_none_unless_asked(monkeypatch):
    monkeypatch.delenv("KVPUSH_BLOCK_SIZE", raising=False)
    args = build_parser().parse_args(["up", "--block-size", "32"])
    stack = Stack("/models/small", nats_url="nats://127.0.0.1:4222", block_size=args.block_size)
    for role in ("prefill", "decode"):
        assert build_parser().parse_args(stack.worker_args(role, f"{role}-0")).block_size == 32
    plain = Stack("/models/small", nats_url="nats://127.0.0.1:4222")
    assert "--block-size" not in plain.worker_args("decode", "decode-0")
    assert build_parser().parse_args(plain.worker_args("decode", "decode-0")).block_size == 0  # vLLM's default


def test_a_worker_takes_its_block_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVPUSH_BLOCK_SIZE", "64")
    args = build_parser().parse_args(["worker", "--role", "prefill"])
    assert args.block_size == 64


def test_the_bench_gives_kvpush_and_vllm_serve_the_same_block_size(monkeypatch):
    monkeypatch.delenv("KVPUSH_BLOCK_SIZE", raising=False)
    assert build_parser().parse_args(["bench", "--block-size", "32"]).block_size == 32
    vllm = VllmServeSystem("vllm-nixl", "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"),
                           block_size=32)
    for role in ("prefill", "decode"):
        assert vllm.serve_command(role, 8100, f"{role}-0")[-2:] == ["--block-size", "32"]
    stack = KvpushSystem("/models/tiny", 512, Topology(), "auto", Path("/nonexistent"), "http://127.0.0.1:1",
                         block_size=32).stack
    stack.nats_url = "nats://127.0.0.1:4222"
    assert build_parser().parse_args(stack.worker_args("prefill", "prefill-0")).block_size == 32
    default = VllmServeSystem("vllm-nixl", "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"))
    assert "--block-size" not in default.serve_command("decode", 8200, "decode-0")


@pytest.mark.parametrize("size,on_cpu,refused", [
    (None, True, False), (32, True, False), (64, True, False), (16, False, False),
    (16, True, True), (48, True, True), (0, False, True), (-32, True, True),
])
def test_a_block_size_the_engine_cannot_take_is_refused_with_a_sentence(size, on_cpu, refused):
    problem = block_size_problem(size, on_cpu)
    assert (problem is not None) == refused
    if refused:
        assert "--block-size" in problem


def test_the_worker_refuses_16_on_cpus_before_any_engine_starts(capsys):
    args = build_parser().parse_args(["worker", "--role", "decode", "--block-size", "16"])
    assert args.func(args) == 2
    assert "multiples of 32" in capsys.readouterr().err + capsys.readouterr().out


def test_vllm_builds_the_engine_with_the_sizes_it_was_given_and_the_heartbeat_counts_a_blocks_bytes():
    model = str(build_model(default_model_dir("small"), profile="small"))
    settings = EngineSettings(model=model, role="decode", engine_id="b", nats_url="nats://127.0.0.1:4222",
                              connector="kvpush", block_size=32, max_num_seqs=128)
    config = engine.engine_args(settings).create_engine_config(UsageContext.ENGINE_CONTEXT)
    assert config.cache_config.block_size == 32
    assert config.scheduler_config.max_num_seqs == 128
    default = engine.engine_args(EngineSettings(model=model, role="decode", engine_id="b",
                                                nats_url="nats://127.0.0.1:4222", connector="kvpush"))
    default_config = default.create_engine_config(UsageContext.ENGINE_CONTEXT)
    assert engine.kv_bytes_per_block(config) * default_config.cache_config.block_size == \
        engine.kv_bytes_per_block(default_config) * 32


def test_the_bench_gives_every_engine_the_same_max_num_seqs_when_asked(monkeypatch):
    """kvpush's workers run 16 requests at once and vllm serve 128 on CPUs: at 8 req/s of
    512/128 the published table's load kept 19 in decode, and kvpush's 16 queued the rest
    (issue 45's first calibration run). ``--max-num-seqs`` sets one figure for both."""
    monkeypatch.delenv("KVPUSH_MAX_NUM_SEQS", raising=False)
    assert build_parser().parse_args(["bench", "--max-num-seqs", "128"]).max_num_seqs == 128
    vllm = VllmServeSystem("vllm-nixl", "/models/tiny", "tiny", 512, Topology(), "auto", Path("/nonexistent"),
                           max_num_seqs=128)
    assert vllm.serve_command("decode", 8200, "decode-0")[-2:] == ["--max-num-seqs", "128"]
    stack = KvpushSystem("/models/tiny", 512, Topology(), "auto", Path("/nonexistent"), "http://127.0.0.1:1",
                         max_num_seqs=128).stack
    stack.nats_url = "nats://127.0.0.1:4222"
    assert build_parser().parse_args(stack.worker_args("decode", "decode-0")).max_num_seqs == 128
    plain = Stack("/models/small", nats_url="nats://127.0.0.1:4222")
    assert build_parser().parse_args(plain.worker_args("decode", "decode-0")).max_num_seqs == 16  # kvpush's own
