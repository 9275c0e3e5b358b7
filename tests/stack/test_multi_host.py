"""kvpush across three hosts (tools/hosts/rig.py): network namespaces on one switch, a
three-server NATS cluster with JetStream R3, the schedulers and gateway on h1, prefill on
h2, decode on h3, NIXL over UCX TCP between h2 and h3. Requests cross all three hosts and
their outputs equal a single vLLM instance's; tc's counter on the prefill host shows the KV
went over the link. Then one NATS server dies mid-stream, and the link between prefill and
decode is cut during a write (held open by a chaos hook), while both stay on NATS."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from kvpush.shared import wire
from tests import prompts
from tests.early import EARLY
from kvpush.tools.hosts.network import Network, run
from kvpush.tools.hosts.rig import PLACEMENT, running_multi_host_rig
from kvpush.tools.reliability.fault_rig import DEADLINE_S, wait_until

pytestmark = pytest.mark.timeout(900)

PUSHED, PULLED, VIA_GATEWAY = 4, 6, 5  # prompts.CORRECTNESS indices: a prompt each, none cached yet
STREAM = len(prompts.CORRECTNESS) + 3  # prompts.STREAM_PROMPT in the reference


@pytest.fixture(scope="module", autouse=True)
def switch_to_itself():
    """The session's lane puts the emulated point's hosts on the same 198.18.0.0/24 switch
    (tests/early.py): one run holds it at a time."""
    EARLY.wait_for("emulation")


@pytest.fixture(scope="module")
async def rig(model_dir, tmp_path_factory):
    async with running_multi_host_rig(tmp_path_factory.mktemp("multi-host"), model_dir, prompts.MAX_MODEL_LEN) as rig:
        yield rig


def test_a_run_that_was_killed_leaves_nothing_the_next_run_trips_on():
    """A run killed mid-test never deletes its namespaces, and its operator link keeps
    198.18.0.254/24 in the root namespace: the kernel routed the next run's monitor probes
    through that dead switch, and CI's multi-host rig saw "connection refused" for 60 s."""
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process id that no longer runs: the killed run's
    killed = Network(tag=f"kvp{gone.pid}").start()
    try:
        killed.add_host("h1", 1)  # and never stopped
        with Network() as net:
            net.add_host("h1", 1)
            assert not [ns for ns in run("ip", "netns", "list").split() if ns.startswith(f"kvp{gone.pid}-")]
            assert f"dev {net.tag}op " in run("ip", "route", "get", "198.18.0.1")
    finally:
        killed.stop()  # where the sweep did its work, nothing is left: said without error


def kv_bytes_per_token(model_dir: str) -> int:
    """Keys and values of one token in every layer, as the engines store them (float32 here)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("dtype") or config.get("torch_dtype")]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * dtype_bytes


def full_blocks_bytes(prompt: list[int], model_dir: str) -> int:
    return len(prompt) // prompts.BLOCK_SIZE * prompts.BLOCK_SIZE * kv_bytes_per_token(model_dir)


def on_host(pid: int, netns: str) -> bool:
    """Whether process ``pid`` lives in network namespace ``netns`` (the same inode)."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{netns}").st_ino


async def test_each_service_runs_on_its_own_host(rig):
    placed = {name: PLACEMENT[name.split("-")[0]] for name, _ in rig.stack.children}
    assert set(placed.values()) == {"h1", "h2", "h3"}
    for name, process in rig.stack.children:
        assert on_host(process.pid, rig.network.hosts[placed[name]].netns), name
    assert not on_host(os.getpid(), rig.network.hosts["h1"].netns)  # the test is the operator, outside


@pytest.mark.parametrize("index,mode", [(PUSHED, "push"), (PULLED, "pull")])
async def test_requests_cross_three_hosts_and_the_kv_crosses_the_link_over_tcp(rig, reference, model_dir,
                                                                                index, mode):
    _, prompt, max_tokens = prompts.CORRECTNESS[index]
    before = rig.prefill_host.bytes_to(rig.decode_host)
    outcome = await rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens, "transfer_mode": mode})
    assert isinstance(outcome.final, wire.FinalReply), outcome.final
    assert outcome.tokens == reference[index]
    sent = rig.prefill_host.bytes_to(rig.decode_host) - before
    # UCX_TLS=tcp: had shared memory or CMA carried the KV, the link would not have seen it.
    assert sent >= full_blocks_bytes(prompt, model_dir), (sent, full_blocks_bytes(prompt, model_dir))


async def test_the_gateway_on_h1_serves_the_openai_api_to_another_host(rig, reference):
    _, prompt, max_tokens = prompts.CORRECTNESS[VIA_GATEWAY]
    client = AsyncOpenAI(base_url=rig.stack.gateway_url + "/v1", api_key="unused", max_retries=0)
    try:
        reply = await client.completions.create(model="small", prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, extra_body={"ignore_eos": True,
                                                                           "return_token_ids": True})
    finally:
        await client.close()
    assert reply.choices[0].token_ids == reference[VIA_GATEWAY]


async def test_one_nats_server_killed_mid_stream_every_request_ends_and_the_cluster_heals(rig, reference):
    """Three requests stream when the server leading the flights bucket dies. Each ends with
    the reference output, or with a clear error (a stream through the dead server loses
    the chunks it held: ``stream_lost``), within the deadline. A request sent at once, in
    the election that follows, is served through the other two servers. The server comes
    back and the cluster is whole again."""
    victim = rig.cluster.leader_of(f"KV_{wire.FLIGHTS_BUCKET}")
    streamed: dict[int, int] = {}

    def counting(i):
        async def on_reply(reply):
            streamed[i] = streamed.get(i, 0) + 1
        return on_reply

    body = {"prompt_token_ids": prompts.STREAM_PROMPT, "max_tokens": prompts.STREAM_MAX_TOKENS,
            "transfer_mode": "push"}
    served = [asyncio.create_task(rig.request({**body, "request_id": f"killed-nats-{i}"}, on_reply=counting(i)))
              for i in range(3)]
    await wait_until(lambda: len(streamed) == 3, 120, "all three requests streaming")
    rig.cluster.kill(victim)
    _, prompt, max_tokens = prompts.CORRECTNESS[3]
    during = await rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens}, timeout=60)
    assert isinstance(during.final, wire.FinalReply), during.final  # its flight record waited out the election
    assert during.tokens == reference[3]
    for outcome in await asyncio.gather(*served):
        assert outcome.seconds < DEADLINE_S + 10, outcome
        if isinstance(outcome.final, wire.ErrorReply):
            assert outcome.final.error.code and outcome.final.error.message, outcome.final
        else:
            assert outcome.tokens == reference[STREAM], outcome.request_id
    rig.assert_nothing_else_died()
    services = {"scheduler-0", "scheduler-1", "prefill-0", "decode-0"}
    connected = {name for member in rig.cluster.members if member.alive() for name in rig.cluster.connections(member)}
    assert services <= connected  # every service is on one of the other two now

    await asyncio.to_thread(rig.cluster.restart, victim)
    assert rig.cluster.healthy() is None  # routes to both others, JetStream current
    _, prompt, max_tokens = prompts.CORRECTNESS[2]
    after = await rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens})
    assert isinstance(after.final, wire.FinalReply), after.final
    assert after.tokens == reference[2]
    await rig.assert_blocks_back()


async def test_cutting_the_link_between_prefill_and_decode_during_a_write(rig, reference):
    """Prefill's write is posted and held there (``transfer.posted``: the transfer thread
    drives UCX, so nothing moves); the link between h2 and h3 is cut, NATS ports excepted;
    the write goes on. UCX gives up on the peer, the write fails (the transfer thread lives
    on), and the request ends by the integrity rules: the reference output (decode computes
    the prompt itself, or a retry writes it once the link is back) or a clear error. Then
    every block is back on both sides, and the next write crosses the mended link."""
    events, sub = await rig.observe("scheduler", wire.COMPLETION_SUBJECTS, wire.Completion)
    index = 7  # prompts.CORRECTNESS: near the context, not cached anywhere yet
    _, prompt, max_tokens = prompts.CORRECTNESS[index]
    prefill, decode = rig.prefill_host, rig.decode_host
    rig.hold("transfer.posted")
    try:
        served = asyncio.create_task(rig.request({"prompt_token_ids": prompt, "max_tokens": max_tokens,
                                                  "transfer_mode": "push", "request_id": "cut-write"}))
        await rig.wait_held("transfer.posted", 120)  # prefill's write is posted
        prefill.cut(decode)
        decode.cut(prefill)
        rig.release()
        failed = await wait_until(lambda: [e for e in events if isinstance(e, wire.TransferFailed)], 60,
                                  "prefill reporting the write failed")
        assert failed[0].prefill_engine_id == "prefill-0"
        assert prefill.dropped_to(decode) > 0  # the cut, not something else, ended it
    finally:
        rig.release()
        prefill.mend(decode)
        decode.mend(prefill)
        await sub.unsubscribe()
    outcome = await served
    assert outcome.seconds < DEADLINE_S + 10
    if isinstance(outcome.final, wire.ErrorReply):
        assert outcome.final.error.code and outcome.final.error.message, outcome.final
    else:
        assert outcome.tokens == reference[index]
    await rig.assert_blocks_back(timeout=60)
    rig.assert_nothing_else_died()

    before = prefill.bytes_to(decode)
    after = await rig.request({"prompt_token_ids": prompts.CROSS_TARGET, "max_tokens": prompts.CROSS_MAX_TOKENS,
                               "transfer_mode": "push"})
    assert isinstance(after.final, wire.FinalReply), after.final
    assert after.tokens == reference[len(prompts.CORRECTNESS)]  # CROSS_TARGET's place in the reference
    await rig.assert_pushed(after)  # written over the mended link, not computed by decode
    assert prefill.bytes_to(decode) > before
