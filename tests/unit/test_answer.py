"""A decode job's answer stream (services/worker/answer.py): what it sends of its engine's
outputs (a replay continuation's tokens the client has are not sent again), the seq and
token counts of its chunks, and the final it makes of them. vLLM's outputs are plain
objects here, as the core reads them by attribute."""

from __future__ import annotations

from types import SimpleNamespace

from kvpush.services.worker.answer import Answer
from kvpush.shared import wire

WORDS = {1: "a", 2: " b", 3: " c", 4: " d", 5: " e"}
PROMPT = list(range(100, 110))  # 10 tokens


def _text(token_ids: list[int]) -> str:
    return "".join(WORDS[t] for t in token_ids)


def _output(token_ids: list[int], finish_reason: str | None = None):
    """vLLM's CompletionOutput, as the core reads it."""
    return SimpleNamespace(token_ids=token_ids, text=_text(token_ids), logprobs=[[t] for t in token_ids],
                           finish_reason=finish_reason)


def _request_output(token_ids: list[int], finish_reason: str | None = None, cached: int = 0):
    """vLLM's RequestOutput, as the core reads it (its logprobs: a ``{token id: Logprob}`` per token)."""
    completion = _output(token_ids, finish_reason)
    completion.logprobs = [{t: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=WORDS[t])} for t in token_ids]
    return SimpleNamespace(outputs=[completion], num_cached_tokens=cached, kv_transfer_params=None,
                           prompt_logprobs=None)


def _job(resume: wire.Resume | None = None, n: int = 1, mode: str = "push", prompt_logprobs: int | None = None,
         received_at: float = 100.0) -> wire.DecodeJob:
    sampling = wire.SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=False, n=n,
                                 prompt_logprobs=prompt_logprobs)
    prompt = PROMPT + (resume.token_ids if resume is not None and resume.continuation == "reprefill" else [])
    return wire.DecodeJob(request_id="r", transfer_id="t", prompt_token_ids=prompt, sampling=sampling,
                          prefill_engine_id="prefill-0", reply_to="_INBOX.x", received_at=received_at, mode=mode,
                          resume=resume)


def _send(answer: Answer, index: int, token_ids: list[int], now: float,
          finish_reason: str | None = None) -> wire.TokenChunk | None:
    """What decode does with one engine output: the chunk it sends, or None (nothing new)."""
    output = _request_output(token_ids, finish_reason)
    answer.saw(index, output, computing=False)
    new = answer.unreplayed(index, output.outputs[0], _text)
    return answer.chunk(index, new, now) if new.token_ids else None


def test_replayed_outputs_are_dropped_and_a_straddling_one_keeps_only_its_new_tokens_text():
    resume = wire.Resume(token_ids=[1, 2, 3], chunks=3, first_token_at=1.0, continuation="replay")
    answer = Answer(_job(resume))
    assert (answer.so_far.chunks, answer.completion_tokens, answer.replay_left) == (3, 3, 3)
    assert answer.unreplayed(0, _output([1]), _text) == ([], "", None)
    # two steps in one output: the replay's last token and the first new one
    assert answer.unreplayed(0, _output([2, 3, 4]), _text) == ([4], " d", [[4]])
    assert answer.unreplayed(0, _output([5]), _text) == ([5], " e", [[5]])  # past the replay: as is


def test_a_reprefill_or_a_fresh_request_replays_nothing():
    for resume in (None, wire.Resume(token_ids=[1, 2], chunks=2, first_token_at=1.0, continuation="reprefill")):
        answer = Answer(_job(resume))
        assert answer.replay_left == 0
        assert answer.unreplayed(0, _output([3]), _text) == ([3], " c", [[3]])


def test_chunks_are_numbered_in_the_order_they_go_out_and_their_tokens_counted():
    answer = Answer(_job(n=2))
    sent = [_send(answer, 0, [1, 2], 101.0), _send(answer, 1, [3], 101.5), _send(answer, 0, [4], 102.0)]
    assert [(c.seq, c.index, c.token_ids) for c in sent] == [(0, 0, [1, 2]), (1, 1, [3]), (2, 0, [4])]
    assert sent[0].logprobs == [[wire.TokenLogprob(1, -0.5, 1, "a")], [wire.TokenLogprob(2, -0.5, 1, " b")]]
    assert (answer.so_far.chunks, answer.so_far.tokens, answer.completion_tokens) == (3, [1, 2, 4], 4)
    assert answer.sent_here
    assert _send(answer, 0, [], 103.0) is None  # an output with no token is not a chunk
    assert answer.so_far.chunks == 3


def test_a_resumed_stream_goes_on_from_the_chunks_its_client_has():
    resume = wire.Resume(token_ids=[1, 2], chunks=2, first_token_at=101.0, continuation="reprefill")
    answer = Answer(_job(resume))
    assert not answer.sent_here  # another decode sent those
    chunk = _send(answer, 0, [3], 105.0)
    assert (chunk.seq, answer.so_far.tokens, answer.completion_tokens) == (2, [1, 2, 3], 3)
    final = answer.final(answer.timings(106.0), None, None)
    assert final.chunks == 3
    assert final.timings.ttft_ms == 1000.0  # its first token went out from the first decode


def test_a_replay_sends_only_what_follows_the_tokens_its_client_has():
    resume = wire.Resume(token_ids=[1, 2, 3], chunks=3, first_token_at=101.0, continuation="replay")
    answer = Answer(_job(resume))
    assert _send(answer, 0, [1, 2], 104.0) is None  # replayed: its client has them
    straddling = _send(answer, 0, [3, 4], 104.5)
    assert (straddling.seq, straddling.token_ids, straddling.text) == (3, [4], " d")
    assert (answer.so_far.chunks, answer.so_far.tokens, answer.completion_tokens) == (4, [1, 2, 3, 4], 4)
    assert _send(answer, 0, [5], 105.0).seq == 4


def test_ttft_is_the_first_token_and_tpot_spreads_the_rest_of_answer_0_to_the_last():
    answer = Answer(_job(n=2, received_at=100.0))
    _send(answer, 0, [1], 100.5)  # the first token, 500 ms after the request arrived
    _send(answer, 1, [1, 2, 3, 4, 5], 101.0)  # the other answer's tokens are not answer 0's
    _send(answer, 0, [2, 3], 101.5)
    timings = answer.timings(102.5)  # the last token
    assert (timings.ttft_ms, timings.tpot_ms, timings.e2e_ms) == (500.0, 1000.0, 2500.0)  # 2 s over 2 tokens


def test_a_single_token_has_no_tpot_and_an_answer_with_none_takes_its_end_as_first_token():
    answer = Answer(_job(received_at=100.0))
    _send(answer, 0, [1], 100.25)
    assert answer.timings(101.0).tpot_ms == 0.0
    nothing = Answer(_job(received_at=100.0)).timings(100.75)
    assert (nothing.ttft_ms, nothing.tpot_ms, nothing.e2e_ms) == (750.0, 0.0, 750.0)


def test_with_n_answers_the_final_says_each_ones_finish_reason_and_counts_all_their_tokens():
    answer = Answer(_job(n=3))
    _send(answer, 1, [1], 101.0, finish_reason="stop")
    _send(answer, 0, [2, 3], 101.0, finish_reason="length")
    final = answer.final(answer.timings(102.0), None, None)
    assert (final.finish_reason, final.finish_reasons) == ("length", ["length", "stop", None])  # answer 2 unfinished
    assert final.usage.completion_tokens == 3
    single = Answer(_job())
    _send(single, 0, [1], 101.0, finish_reason="stop")
    assert single.final(single.timings(102.0), None, None).finish_reasons is None


def test_the_finals_usage_counts_a_reprefills_tokens_sent_as_completion_not_prompt():
    resume = wire.Resume(token_ids=[1, 2, 3], chunks=2, first_token_at=101.0, continuation="reprefill")
    answer = Answer(_job(resume))
    assert len(answer.job.prompt_token_ids) == 13  # the prompt the attempt computed
    _send(answer, 0, [4], 103.0)
    usage = answer.final(answer.timings(104.0), wire.PromptReport(cached_tokens=7), None).usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (10, 4, 7)
    fresh = Answer(_job())
    assert fresh.final(fresh.timings(104.0), None, None).usage == wire.Usage(10, 0)  # prefill's count unknown


def test_a_local_answers_cached_tokens_are_its_own_engines():
    answer = Answer(_job(mode="local"))
    answer.saw(0, _request_output([1], cached=4), computing=True)
    assert (answer.local_prompt.cached_tokens, answer.cached_here) == (4, 4)
    assert answer.final(answer.timings(101.0), None, None).usage.cached_tokens == 4


def test_only_answer_0s_first_chunk_of_a_fresh_request_carries_the_prompt_logprobs():
    answer = Answer(_job(n=2, prompt_logprobs=1))
    assert not answer.prompt_logprobs_due(1)
    assert answer.prompt_logprobs_due(0)
    _send(answer, 0, [1], 101.0)
    assert not answer.prompt_logprobs_due(0)
    resumed = wire.Resume(token_ids=[1], chunks=1, first_token_at=101.0, continuation="replay")
    assert not Answer(_job(resumed, prompt_logprobs=1)).prompt_logprobs_due(0)  # its client has them
    assert not Answer(_job()).prompt_logprobs_due(0)  # not asked for


def test_a_lost_kv_is_recomputed_only_before_a_chunk_went_out_and_when_the_policy_allows():
    assert Answer(_job()).recomputes_lost_kv()
    assert not Answer(_job(), worker_kv_policy="fail").recomputes_lost_kv()
    sent = Answer(_job())
    _send(sent, 0, [1], 101.0)
    assert not sent.recomputes_lost_kv()
    assert sent.kv_failed_message() == "the prompt's KV cache was found lost after tokens went out"
    assert "--on-kv-failure fail" in Answer(_job(), worker_kv_policy="fail").kv_failed_message()


def test_the_path_says_decode_computed_the_prompt_after_the_kv_failed():
    answer = Answer(_job(mode="pull"))
    answer.computed_here = True
    output = _request_output([1], cached=3)
    output.kv_transfer_params = {wire.LOAD_FAILURE_KEY: {"code": "kv_load_failed", "reason": "timed out"}}
    answer.saw(0, output, computing=True)
    path = answer.path("decode-0", wire.PromptReport(cached_tokens=0))
    assert (path.decode_worker, path.decode_cached_tokens, path.decode_computed_tokens, path.recomputed_tokens,
            path.kv_failure, path.kv_failure_reason) == ("decode-0", 3, 7, 7, "kv_load_failed", "timed out")
