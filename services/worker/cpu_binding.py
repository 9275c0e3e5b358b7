"""Where an engine's ranks run on CPUs: values of vLLM's ``VLLM_CPU_OMP_THREADS_BIND``.

vLLM's CPU backend runs tensor parallelism with one worker process per rank, and binds
each rank's OpenMP threads to a core list of its own: the variable holds one list per rank,
separated by ``|`` ("0|1": rank 0 on core 0, rank 1 on core 1). Its default, ``auto``, gives
each rank a NUMA node of its own and refuses to start with fewer nodes than ranks, which is
every one-node machine. So at TP above 1 kvpush names the lists itself, unless the
environment already does (docs/tensor-parallel.md, "CPUs: binding and the executor's spin").

Two ways to place several engines on cores (``Placement``):

- ``SPREAD``: each engine's ranks over all the cores it is given, one share each. Two TP-2
  engines on two cores: "0|1" and "0|1", each core holding one rank of each engine.
- ``PACKED``: each engine on a core share of its own, its ranks together on it. Two TP-2
  engines on two cores: "0|0" and "1|1".

Pure: the cores come in as a list (``os.sched_getaffinity(0)`` where it runs).
"""

from __future__ import annotations

import enum

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
VLLM_DEFAULT = "auto"


class Placement(enum.Enum):
    SPREAD = "spread"
    PACKED = "packed"


def rank_lists(cores: list[int], ranks: int) -> list[list[int]]:
    """``cores`` shared among ``ranks`` in order: rank r gets an equal run of its own (the
    last ranks one core fewer when they do not divide), or, with fewer cores than ranks,
    core r mod the number of cores."""
    if ranks < 1 or not cores:
        raise ValueError(f"{ranks} ranks on cores {cores}: need at least one of each")
    if len(cores) < ranks:
        return [[cores[r % len(cores)]] for r in range(ranks)]
    share, extra = divmod(len(cores), ranks)
    lists, start = [], 0
    for r in range(ranks):
        end = start + share + (1 if r < extra else 0)
        lists.append(cores[start:end])
        start = end
    return lists


def bind_value(lists: list[list[int]]) -> str:
    """The variable's text for these per-rank lists: ``0,1|2,3``."""
    return "|".join(",".join(str(core) for core in cores) for cores in lists)


def engine_bindings(cores: list[int], tensor_parallel_sizes: list[int],
                    placement: Placement = Placement.SPREAD) -> list[str]:
    """One binding per engine, for engines of these TP sizes sharing ``cores``.

    When there are cores enough for every rank of every engine, each engine gets a share of
    its own, split among its ranks, whatever the placement. Otherwise ``SPREAD`` gives every
    engine all the cores, split among its ranks; ``PACKED`` gives engine i the core share
    i would get with one rank per engine, all its ranks on it."""
    sorted_cores = sorted(cores)
    if sum(tensor_parallel_sizes) <= len(sorted_cores):
        shares = rank_lists(sorted_cores, len(tensor_parallel_sizes))
        return [bind_value(rank_lists(share, tp)) for share, tp in zip(shares, tensor_parallel_sizes)]
    if placement is Placement.SPREAD:
        return [bind_value(rank_lists(sorted_cores, tp)) for tp in tensor_parallel_sizes]
    shares = rank_lists(sorted_cores, len(tensor_parallel_sizes))
    return [bind_value([share] * tp) for share, tp in zip(shares, tensor_parallel_sizes)]


def default_binding(tensor_parallel_size: int, cores: list[int], environ: dict[str, str]) -> str | None:
    """The binding an engine of this TP is started with when ``environ`` names none: at TP 1,
    none (vLLM's own ``auto`` binds one rank well); above, its ranks spread over ``cores``.
    A binding in ``environ`` is kept as it is, ``auto`` included."""
    if tensor_parallel_size <= 1 or BIND_ENV in environ:
        return None
    return bind_value(rank_lists(sorted(cores), tensor_parallel_size))
