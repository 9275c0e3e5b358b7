"""Where an engine's ranks run on CPUs (services/worker/cpu_binding.py): one core list per
rank, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` takes them, for one engine and for several
sharing a machine."""

from __future__ import annotations

import pytest

from kvpush.services.worker.cpu_binding import (BIND_ENV, Placement, bind_value, default_binding, engine_bindings,
                                                rank_lists)


def test_each_rank_gets_an_equal_run_of_the_cores_or_shares_them_when_too_few():
    assert rank_lists([0, 1], 2) == [[0], [1]]
    assert rank_lists([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert rank_lists([0, 1, 2], 2) == [[0, 1], [2]]
    assert rank_lists([4, 5], 4) == [[4], [5], [4], [5]]
    assert rank_lists([0, 1], 1) == [[0, 1]]
    with pytest.raises(ValueError):
        rank_lists([], 2)


def test_the_variable_holds_one_list_per_rank_separated_by_bars():
    assert bind_value([[0], [1]]) == "0|1"
    assert bind_value([[0, 1], [2, 3]]) == "0,1|2,3"
    assert bind_value([[3]]) == "3"


def test_engines_with_cores_enough_get_shares_of_their_own_whatever_the_placement():
    for placement in Placement:
        assert engine_bindings(list(range(8)), [2, 2], placement) == ["0,1|2,3", "4,5|6,7"]
        assert engine_bindings([0, 1, 2], [2, 1], placement) == ["0|1", "2"]


def test_two_tp2_engines_on_two_cores_spread_over_both_or_packed_one_on_each():
    assert engine_bindings([1, 0], [2, 2], Placement.SPREAD) == ["0|1", "0|1"]
    assert engine_bindings([1, 0], [2, 2], Placement.PACKED) == ["0|0", "1|1"]
    assert engine_bindings([0, 1], [2, 2, 2], Placement.PACKED) == ["0|0", "1|1", "0|0"]


def test_an_engine_above_tp1_gets_its_ranks_spread_unless_the_environment_names_a_binding():
    assert default_binding(2, [1, 0], {}) == "0|1"
    assert default_binding(4, [0, 1, 2, 3, 4, 5, 6, 7], {}) == "0,1|2,3|4,5|6,7"
    assert default_binding(1, [0, 1], {}) is None  # vLLM's own binding of one rank stands
    assert default_binding(2, [0, 1], {BIND_ENV: "0|0"}) is None
    assert default_binding(2, [0, 1], {BIND_ENV: "auto"}) is None  # asked for: vLLM's answer stands
