"""``kvpush up --prefill-tp N --decode-tp M`` (services/launch/stack.py): each worker's command
line carries its role's TP, which the real CLI parses into the worker's engine settings, and
each engine above TP 1 gets one core list per rank unless the environment names a binding.
Nothing is started."""

from __future__ import annotations

import os

import pytest

from kvpush.services.cli.main import build_parser
from kvpush.services.launch.stack import Stack
from kvpush.services.worker.cpu_binding import BIND_ENV, Placement, engine_bindings


def _stack(monkeypatch, **kwargs) -> Stack:
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv("KVPUSH_TENSOR_PARALLEL_SIZE", raising=False)
    return Stack("/models/small", nats_url="nats://127.0.0.1:4222", **kwargs)


def test_up_takes_a_tp_per_role_and_each_worker_is_started_with_its_own(monkeypatch):
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "1"])
    assert (args.prefill_tp, args.decode_tp) == (2, 1)
    stack = _stack(monkeypatch, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
    prefill = build_parser().parse_args(stack.worker_args("prefill", "prefill-0"))
    decode = build_parser().parse_args(stack.worker_args("decode", "decode-0"))
    assert (prefill.role, prefill.tensor_parallel_size) == ("prefill", 2)
    assert (decode.role, decode.tensor_parallel_size) == ("decode", 1)
    assert "--tensor-parallel-size" not in stack.worker_args("decode", "decode-0")  # TP 1: as before


def test_a_worker_takes_its_tp_from_the_environment_as_compose_and_kubernetes_set_it(monkeypatch):
    monkeypatch.setenv("KVPUSH_TENSOR_PARALLEL_SIZE", "4")
    assert build_parser().parse_args(["worker", "--role", "decode"]).tensor_parallel_size == 4
    monkeypatch.delenv("KVPUSH_TENSOR_PARALLEL_SIZE")
    assert build_parser().parse_args(["worker", "--role", "decode"]).tensor_parallel_size == 1


def test_each_engine_above_tp1_gets_one_core_list_per_rank_as_the_placement_shares_the_cores(monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    for placement in Placement:
        stack = _stack(monkeypatch, prefill=1, decode=2, prefill_tp=2, decode_tp=2, placement=placement)
        expected = engine_bindings(cores, [2, 2, 2], placement)
        seen = [stack.worker_binding(role, name) for role, name in
                (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1"))]
        assert seen == [{BIND_ENV: binding} for binding in expected]
        assert all(len(binding.split("|")) == 2 for binding in expected)  # one list per rank
        assert stack.worker_binding("decode", "decode-0") == stack.worker_binding("decode", "decode-0")  # a restart
        assert stack.worker_binding("decode", "decode-9") == {BIND_ENV: engine_bindings(cores, [2] * 4, placement)[3]}


def test_an_engine_at_tp1_or_a_binding_in_the_environment_is_left_as_it_is(monkeypatch):
    stack = _stack(monkeypatch, prefill_tp=2, decode_tp=1)
    assert stack.worker_binding("decode", "decode-0") == {}
    monkeypatch.setenv(BIND_ENV, "0|0")
    assert stack.worker_binding("prefill", "prefill-0") == {}  # the user's, inherited
    monkeypatch.delenv(BIND_ENV)
    pinned = Stack("/models/small", nats_url="nats://127.0.0.1:4222", prefill_tp=2,
                   role_env={"prefill-0": {BIND_ENV: "1|1"}})
    assert pinned.worker_binding("prefill", "prefill-0") == {}  # this worker's own
    assert pinned.worker_binding("prefill", "prefill-1") != {}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_worker_command_still_parses_at_tp1(monkeypatch, role):
    args = build_parser().parse_args(_stack(monkeypatch).worker_args(role, f"{role}-0"))
    assert args.tensor_parallel_size == 1 and args.role == role


def test_a_worker_named_in_worker_tp_runs_at_its_own_tp_and_the_others_at_their_roles(monkeypatch):
    """One rig with engines of both sizes per role (tests/stack/test_tensor_parallel.py)."""
    cores = sorted(os.sched_getaffinity(0))
    stack = _stack(monkeypatch, prefill=2, decode=2, prefill_tp=2, decode_tp=2,
                   worker_tp={"prefill-1": 1, "decode-1": 1})
    sizes = {name: build_parser().parse_args(stack.worker_args(role, name)).tensor_parallel_size
             for role, name in (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"),
                                ("decode", "decode-1"))}
    assert sizes == {"prefill-0": 2, "prefill-1": 1, "decode-0": 2, "decode-1": 1}
    expected = engine_bindings(cores, [2, 1, 2, 1], Placement.SPREAD)
    assert stack.worker_binding("prefill", "prefill-0") == {BIND_ENV: expected[0]}
    assert stack.worker_binding("decode", "decode-0") == {BIND_ENV: expected[2]}
    assert stack.worker_binding("prefill", "prefill-1") == stack.worker_binding("decode", "decode-1") == {}  # TP 1
