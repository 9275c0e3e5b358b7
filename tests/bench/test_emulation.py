"""Emulated GPUs (tools/emulation), one tiny point in CI: the timed model in a real vLLM engine,
a NIXL WRITE through a link shaped with tc, and the plugin's switches for vLLM's NIXL progress
thread and its shared-memory queue's spin. What it asserts: a forward's wall time follows the
time model within 10%, the link carries the rate that was set within 10%, and each switch
reaches what vLLM makes (the agent config, the queue's yield).
The time model's arithmetic is tested in tests/unit/test_time_model.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.whole_group import run_whole
from tests.early import EARLY, EMULATED_DILATION, emulated_point

from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.link import measure
from kvpush.tools.emulation.time_model import Request, step_time
from kvpush.tools.hosts.network import Network

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def machine_to_itself():
    """These tests measure wall time against a time model: the session's background lane
    (tests/early.py) is done first."""
    EARLY.wait_all()

DILATION = 20.0
INPUT_LEN = 512
BATCH = 2


@pytest.fixture(scope="module")
def emulated_point_run():
    return EARLY.result("emulation", emulated_point)


@pytest.fixture(scope="module")
def timed_run(tmp_path_factory):
    log = tmp_path_factory.mktemp("timed") / "forwards.jsonl"
    run = run_whole(
        [sys.executable, "-m", "kvpush.tools.emulation.single", "--profile", "timed-qwen3-32b",
         "--dilation", str(DILATION), "--input-len", str(INPUT_LEN), "--output-len", "8", "--batch", str(BATCH),
         "--repeats", "2", "--log", str(log)],
        timeout=500, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    forwards = [json.loads(line) for line in log.read_text().splitlines()]
    return result, forwards


def test_each_forward_takes_what_the_time_model_says_for_its_batch(timed_run):
    _, forwards = timed_run
    deployment = catalog.deployment("qwen3-32b@p5en")
    assert len(forwards) >= 2 * (1 + 1 + 7)  # per repeat: a 1-token prefill run, a prefill, 7 decode steps
    paced, off = 0, []
    for forward in forwards:
        batch = [Request(new, context) for new, context in forward["batch"]]
        assert forward["modeled_s"] == pytest.approx(step_time(deployment, batch).seconds, rel=1e-9)
        assert forward["target_s"] == pytest.approx(forward["modeled_s"] * DILATION, rel=1e-9)
        if forward["busy_s"] < 0.8 * forward["target_s"]:  # the CPU's own work fits inside the target
            paced += 1
            if forward["wall_s"] != pytest.approx(forward["target_s"], rel=0.10):
                off.append(forward)
    assert paced >= 0.8 * len(forwards), f"the CPU's work overran most targets: {forwards}"
    # One forward may miss: pacing sleeps after each layer, so a stall of the machine in the
    # last layers cannot be made up (CI saw one prefill end 0.10 s late on a 0.53 s target,
    # its CPU work well inside it). Two misses, or one far off, is the model not followed.
    assert len(off) <= 1, off
    assert all(f["wall_s"] < 1.5 * f["target_s"] for f in off), off
    prefills = [f for f in forwards if f["batch"] == [[INPUT_LEN, INPUT_LEN]] * BATCH]
    decodes = [f for f in forwards if all(new == 1 for new, _ in f["batch"]) and len(f["batch"]) == BATCH]
    assert prefills and decodes, "the batch read from vLLM's attention metadata"
    assert decodes[0]["batch"][0][1] == INPUT_LEN + 1


def test_the_timed_model_is_deterministic_and_reports_emulated_time(timed_run):
    result, _ = timed_run
    first, second = result["runs"]
    assert first["tokens"] == second["tokens"]
    assert all(len(tokens) == 8 for tokens in first["tokens"])
    deployment = catalog.deployment("qwen3-32b@p5en")
    prefill = step_time(deployment, [Request(INPUT_LEN, INPUT_LEN)] * BATCH).seconds
    assert first["ttft_s"] >= prefill
    assert first["ttft_s"] < 3 * prefill  # emulated: the real seconds were divided by k


@pytest.fixture(scope="module")
def stand_in_run(tmp_path_factory):
    """The stand-in forward at k = 1 (issue 45), Llama-3.3-70B at TP 4 on a P5en (the published
    table's setting), 32-token blocks: one prompt thrice for the corruption check, then a batch
    of two prompts twice."""
    log = tmp_path_factory.mktemp("stand-in") / "forwards.jsonl"
    run = run_whole(
        [sys.executable, "-m", "kvpush.tools.emulation.single", "--profile", "stand-in-llama-3.3-70b",
         "--dilation", "1", "--input-len", str(INPUT_LEN), "--output-len", "8", "--batch", str(BATCH),
         "--repeats", "2", "--block-size", "32", "--corrupt-check", "--log", str(log)],
        timeout=500, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    forwards = [json.loads(line) for line in log.read_text().splitlines()]
    return result, forwards


def test_the_stand_in_costs_the_host_a_small_share_of_the_modeled_step_at_k_1(stand_in_run):
    """Printed, and failed only above 0.5: every bench point checks the ≤ 0.2 rule on its own
    forwards, under its own load."""
    _, forwards = stand_in_run
    assert all(f["dilation"] == 1 for f in forwards)
    busy, target = sum(f["cpu_s"] for f in forwards), sum(f["target_s"] for f in forwards)
    decode = [f for f in forwards if all(new == 1 for new, _ in f["batch"])]
    share, decode_share = busy / target, sum(f["cpu_s"] for f in decode) / sum(f["target_s"] for f in decode)
    print(f"stand-in CPU share at k = 1: {share:.3f} over {len(forwards)} forwards, decode steps {decode_share:.3f}")
    assert share < 0.5 and decode_share < 0.5, (share, decode_share)
    late = [f for f in forwards if f["wall_s"] > 1.10 * f["target_s"] + 0.002]
    assert len(late) <= len(forwards) // 10, late[:3]  # the step's time is the model's, not the host's


def test_the_stand_ins_output_proves_its_kv_a_changed_block_changes_it(stand_in_run):
    result, _ = stand_in_run
    check = result["corrupt_check"]
    assert check["first"] == check["from_cache"]  # the cached blocks read back: the same tokens
    assert check["after_corruption"] != check["first"]  # one value of one block in one layer changed
    first, second = result["runs"]
    assert first["tokens"] == second["tokens"]  # deterministic
    assert first["tokens"][0] != first["tokens"][1]  # and a function of the prompt


def test_a_nixl_write_through_the_shaped_link_gets_the_rate_that_was_set(tmp_path):
    with Network() as net:
        sender, receiver = net.add_host("h2", 2), net.add_host("h3", 3)
        unshaped = measure(sender, receiver, tmp_path / "unshaped", mib=16)
        rate_bits = 200_000_000
        sender.shape(receiver, rate_bits)
        shaped = measure(sender, receiver, tmp_path / "shaped", mib=16)
        assert shaped["bytes_per_s"] * 8 == pytest.approx(rate_bits, rel=0.10), shaped
        assert unshaped["bytes_per_s"] > 2 * shaped["bytes_per_s"], (unshaped, shaped)
        assert sender.bytes_to(receiver) >= 16 << 20  # it crossed the shaped class


def test_the_plugin_paces_the_progress_thread_of_every_nixl_agent_only_when_asked():
    """vLLM's NixlConnector makes its agents through NIXL's wrapper, which starts a progress
    thread with no delay between rounds: a core spun at rest. Paced, it sleeps 1 ms a round."""
    probe = ("import time; from vllm.plugins import load_general_plugins; load_general_plugins();"
             "from vllm import ModelRegistry; from nixl._api import nixl_agent, nixl_agent_config;"
             "agent = nixl_agent('probe', nixl_agent_config(backends=['UCX'])); time.sleep(0.5);"
             "start = time.process_time(); time.sleep(2.0);"
             "print(round((time.process_time() - start) / 2.0, 3), 'KvpushTimedForCausalLM' in ModelRegistry.get_supported_archs())")
    seen = {}
    for switch in ("paced", "on"):
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "KVPUSH_NIXL_PROGRESS_THREAD": switch, "VLLM_LOGGING_LEVEL": "ERROR",
                                  "NIXL_LOG_LEVEL": "WARN"})
        assert run.returncode == 0, run.stderr[-3000:]
        cpu, registered = run.stdout.strip().splitlines()[-1].split()
        assert registered == "True"
        seen[switch] = float(cpu)
    assert seen["paced"] < 0.2 < 0.6 < seen["on"], seen


SHM_QUEUE_PROBE = """
import threading, time
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.device_communicators import shm_broadcast
writer = shm_broadcast.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
reader = shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)
connecting = threading.Thread(target=reader.wait_until_ready)
connecting.start(); writer.wait_until_ready(); connecting.join()
read = []
reading = threading.Thread(target=lambda: [read.append(reader.dequeue()) for _ in range(2)])
reading.start()
writer.enqueue("step")
while not read:
    time.sleep(0.001)
time.sleep(0.1)
start = time.process_time(); time.sleep(0.7); cpu = (time.process_time() - start) / 0.7
writer.enqueue("next step"); reading.join()
print(round(cpu, 3), read == ["step", "next step"])
"""


def test_the_plugin_paces_the_spin_of_vllm_s_shared_memory_queue_unless_told_not_to():
    """At TP > 1 vLLM's executor passes each step through shared-memory queues whose readers
    poll for a second after each read, yielding the core between polls: a core spun while a
    step waits. By default the plugin makes each yield a 100 us sleep. Here a real queue of
    vLLM's, in a process that loaded vLLM's plugins as its engines do: the reader's CPU in
    the second after a read, while nothing comes."""
    seen = {}
    for switch in ("paced", "on"):
        run = subprocess.run([sys.executable, "-c", SHM_QUEUE_PROBE], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "KVPUSH_SHM_SPIN": switch, "VLLM_LOGGING_LEVEL": "ERROR"})
        assert run.returncode == 0, run.stderr[-3000:]
        cpu, delivered = run.stdout.strip().splitlines()[-1].split()
        assert delivered == "True"  # paced, the queue still passes every message
        seen[switch] = float(cpu)
    assert seen["paced"] < 0.3 and seen["on"] > 3 * seen["paced"], seen


def test_kvpush_bench_emulate_runs_a_tiny_point_of_two_systems_through_the_shaped_link(emulated_point_run):
    """CI's tiny point of `kvpush bench --emulate` (run in the session's lane, tests/early.py):
    kvpush push and vLLM's NixlConnector on the stand-in, each engine on a host of its own, the
    KV through the shaped link, times reported divided by k."""
    run, out = emulated_point_run, emulated_point_run.out
    assert run.returncode == 0, run.output()[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["errors"] == []
    points = {p["variant"]: p for p in results["points"]}
    assert set(points) == {"kvpush-push", "vllm-nixl"}
    for variant, point in points.items():
        summary, measured = point["summary"], point["measured_summary"]
        assert summary["completed"] == 2 and summary["dilation"] == EMULATED_DILATION, (variant, point)
        assert summary["p50_ttft_ms"] == pytest.approx(measured["p50_ttft_ms"] / EMULATED_DILATION)
        assert point["cpu_share"]["forwards"] > 0 and point["cpu_share"]["all"] > 0
    assert "prefill compute" in points["kvpush-push"]["segments_ms"], "the workers' spans crossed from their hosts"
    links = {link["system"]: link for link in results["links"]}
    assert set(links) == {"kvpush", "vllm-nixl"}
    kv_bytes = 3 * 512 * 16 * 1024 * 0.9  # the warm-up and two requests, the last block recomputed at most
    for system, link in links.items():
        assert link["rate_bits_per_s"] == pytest.approx(3200e9 * (16 / 256) / EMULATED_DILATION)
        assert link["bytes_sent"]["prefill-0->decode-0"] >= kv_bytes, (system, link)
    # The device is asynchronous (tools/emulation/device.py): each forward returned before its
    # modeled end and sampling waited for it; kvpush's connector took its compute marks (in
    # wait_for_save, for the prompts the step finished) inside the modeled step, not after it.
    marked = []
    for system in ("kvpush", "vllm-nixl"):
        for line in (out / "emulation" / f"{system}-1P1D" / "forwards.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert record["launch_s"] < record["target_s"] <= record["wall_s"] + 1e-4, (system, record)
            assert all(0 <= at < record["target_s"] for _, at in record["marks"]), (system, record)
            marked += [system] * len(record["marks"])
    assert set(marked) == {"kvpush"} and len(marked) >= 3, marked  # the warm-up's and two prompts' steps
    # The prefill's and the decode's forwards are not confined to one core between them, vLLM's
    # included: its NIXL worker pins the thread that builds it, the forward thread, to the last
    # core on CPUs (core 1 for both engines, the decode's worker spinning beside the prefill's
    # forward), and the plugin sets it back, as on a GPU server where no such pin exists.
    for system in ("kvpush", "vllm-nixl"):
        cores_by_engine = {}
        for line in (out / "emulation" / f"{system}-1P1D" / "forwards.jsonl").read_text().splitlines():
            record = json.loads(line)
            cores_by_engine.setdefault(record["pid"], set()).update(record["cores"])
        assert len(cores_by_engine) == 2, (system, cores_by_engine)
        assert set().union(*cores_by_engine.values()) == {0, 1}, (system, cores_by_engine)
