"""What each rank tells the scheduler side after a step (``KvpushWorkerMeta``), merged
by vLLM's own ``KVOutputAggregator`` as a multi-process engine merges its ranks' outputs:
the scheduler side sees a request received, or sent, only once every rank reported it,
a load failed if any rank's failed, a prompt verified only if every rank verified its
heads, and every prefill rank's pull digests."""

from __future__ import annotations

import inspect
import pickle

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvpush.connector.metadata import KvpushWorkerMeta
from kvpush.shared import wire


def _rank_output(sending=(), recving=(), failed=(), meta: KvpushWorkerMeta | None = None) -> ModelRunnerOutput:
    output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    output.kv_connector_output = KVConnectorOutput(finished_sending=set(sending) or None,
                                                   finished_recving=set(recving) or None,
                                                   failed_recving=set(failed), kv_connector_worker_meta=meta)
    return output


def test_a_request_is_received_only_when_every_rank_said_so_and_failed_if_any_rank_failed():
    aggregator = KVOutputAggregator(expected_finished_count=2)  # world size 2: the kvpush connector sets no count
    first = aggregator.aggregate([_rank_output(recving={"r"}, failed={"r"}), _rank_output()]).kv_connector_output
    assert (first.finished_recving, first.failed_recving) == (None, set())  # rank 1 still holds its blocks
    second = aggregator.aggregate([_rank_output(), _rank_output(recving={"r"})]).kv_connector_output
    assert (second.finished_recving, second.failed_recving) == ({"r"}, {"r"})  # rank 1's part landed; rank 0's did not
    sent = aggregator.aggregate([_rank_output(sending={"p"}), _rank_output()]).kv_connector_output
    assert sent.finished_sending is None
    sent = aggregator.aggregate([_rank_output(), _rank_output(sending={"p"})]).kv_connector_output
    assert sent.finished_sending == {"p"}


def test_the_ranks_metas_merge_into_one_the_scheduler_side_reads():
    aggregator = KVOutputAggregator(expected_finished_count=2)
    rank0 = KvpushWorkerMeta({"gone"}, {"r": 1}, {"x": ("checksum_mismatch", "rank 0")},
                             {"t": {0: [["h0", "h1"]]}})
    rank1 = KvpushWorkerMeta(set(), {"r": 1, "s": 1}, {}, {"t": {1: [["h2", "h3"]]}})
    merged = aggregator.aggregate([_rank_output(meta=rank0), _rank_output(meta=rank1)]).kv_connector_output
    meta = merged.kv_connector_worker_meta
    assert meta.given_up == {"gone"} and meta.load_failures == {"x": ("checksum_mismatch", "rank 0")}
    assert meta.verified == {"r": 2, "s": 1}  # "s": one rank so far
    assert meta.pull_digests == {"t": {0: [["h0", "h1"]], 1: [["h2", "h3"]]}}


def test_what_landed_in_each_rank_crosses_to_the_engine_core_and_merges_by_rank():
    """Each decode rank says what landed in its blocks (the path report's ``received_by_rank``);
    a worker's output crosses to the engine core pickled (vLLM's shm queue)."""
    aggregator = KVOutputAggregator(expected_finished_count=2)
    rank0 = KvpushWorkerMeta(received={"r": {0: wire.RankKv(rank=0, blocks=3, bytes=300)}})
    rank1 = KvpushWorkerMeta(received={"r": {1: wire.RankKv(rank=1, blocks=3, bytes=300)},
                                       "s": {1: wire.RankKv(rank=1, blocks=1, bytes=100)}})
    outputs = [pickle.loads(pickle.dumps(_rank_output(meta=meta))) for meta in (rank0, rank1)]
    meta = aggregator.aggregate(outputs).kv_connector_output.kv_connector_worker_meta
    assert meta.received == {"r": {0: wire.RankKv(rank=0, blocks=3, bytes=300),
                                   1: wire.RankKv(rank=1, blocks=3, bytes=300)},
                             "s": {1: wire.RankKv(rank=1, blocks=1, bytes=100)}}
    assert rank0.received == {"r": {0: wire.RankKv(rank=0, blocks=3, bytes=300)}}  # merging leaves each rank's


def test_vllm_passes_a_steps_worker_meta_after_the_handoffs_it_finished_in_that_step():
    """The pull digests fill the handoff in ``update_connector_output``
    (``checksums.HandoffDigests``): that holds while vLLM's ``update_from_output`` frees a
    finished request (``request_finished`` builds the handoff, kept by reference in the
    step's outputs) before it passes the step's connector output on. A vLLM that changes
    this order fails here (and the pulled KV of tests/stack/test_checksums.py would go
    unchecked)."""
    update = inspect.getsource(Scheduler.update_from_output)
    assert update.index("self._free_request(request)") < update.index("self._update_from_kv_xfer_finished(")
    assert "kv_transfer_params=kv_transfer_params" in update  # the dict itself goes into the output
    assert "self.connector.update_connector_output(" in inspect.getsource(Scheduler._update_from_kv_xfer_finished)
