"""``kvpush soak``: a steady stream of requests against the fault rig while faults of every
kind are injected in turn, then the tally: requests sent, faults by kind, requests
lost, wrong outputs, leaked KV blocks, and the worst time to a final message.

Every completed output is compared with what one plain vLLM instance generates for the
same prompt (``kvpush.tools.reference``), so "wrong" means a token differs.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvpush.client import cancel
from kvpush.services.cli.common import model_path, say
from kvpush.shared.errors import KvpushError, to_error_body
from kvpush.tools.reliability.fault_rig import DEADLINE_S, FaultRig, Outcome
from kvpush.shared import settings, wire

# Expected ends of a request under faults: an answer, or one of these codes. no_scheduler:
# the client's request met no subscriber (NATS restarting, schedulers not yet resubscribed);
# it was never accepted, and the client is told at once. worker_lost only with a single
# decode: with two, a stream whose decode dies continues on the other (tallied apart).
EXPECTED_CODES = {"cancelled", "worker_lost", "no_scheduler"}
MESSAGE_CHAOS = {
    "kvpush.kv.register.": {"drop": 0.2, "duplicate": 0.2, "delay": 0.2, "max_delay_s": 0.4},
    "kvpush.kv.completion.": {"drop": 0.2, "duplicate": 0.2, "delay": 0.2, "max_delay_s": 0.4},
}
# The quick ones first, so a short soak (CI's) meets them all; engine kills last.
FAULT_KINDS = ("cancel", "client_gone", "dropped_final", "kill_scheduler", "kill_scheduler_validating", "malformed",
               "forged_registration", "message_chaos", "fenced_decode", "nats_outage", "nats_restart", "kill_decode",
               "kill_decode_mid_stream", "kill_prefill")
FENCED_PAUSE_S = 5.0  # a decode stalled longer than the rig's worker timeout (3 s): its requests are retried
NATS_OUTAGE_S = 5.0  # longer than the rig's worker timeout (3 s)


def soak_prompts(seed: int = 0) -> list[dict]:
    """Prompt lengths around block boundaries and the context, each with its output length."""
    rng = random.Random(seed)
    lengths = [1, 5, 127, 128, 129, 600, 1000, 1024, 1700]
    return [{"prompt_token_ids": [rng.randrange(1, 4096) for _ in range(n)], "max_tokens": 24 if n < 1500 else 16,
             "ignore_eos": True} for n in lengths] + [_long_answer(rng)]


def _long_answer(rng: random.Random) -> dict:
    return {"prompt_token_ids": [rng.randrange(1, 4096) for _ in range(300)], "max_tokens": 160, "ignore_eos": True}


def reference_outputs(model: str, requests: list[dict], folder: Path, max_model_len: int) -> list[list[int]]:
    """What one plain vLLM instance generates for each request (in a child process)."""
    inp, out = folder / "reference-requests.json", folder / "reference.json"
    inp.write_text(json.dumps(requests))
    subprocess.run([sys.executable, "-m", "kvpush.tools.reference", "--model", model, "--requests", str(inp),
                    "--out", str(out), "--max-model-len", str(max_model_len)],
                   check=True, timeout=600, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "ok" or the error code
    lost: list[str] = field(default_factory=list)  # no final message at all
    wrong: list[str] = field(default_factory=list)  # completed, but tokens differ from the reference
    unexpected: list[str] = field(default_factory=list)  # ended with a code the faults do not explain
    faults: Counter = field(default_factory=Counter)
    worst_final_s: float = 0.0
    migrated: int = 0  # answers whose stream continued on another decode after its own died
    worker_lost_with_a_decode_alive: list[str] = field(default_factory=list)
    leaked_blocks: dict[str, int] = field(default_factory=dict)
    died: list[str] = field(default_factory=list)

    def as_dict(self, seconds: float, rate: float) -> dict:
        return {
            "seconds": round(seconds, 1),
            "rate_per_s": rate,
            "requests_sent": self.sent,
            "outcomes": dict(self.outcomes),
            "requests_lost": len(self.lost),
            "migrated": self.migrated,
            "worker_lost_with_a_decode_alive": len(self.worker_lost_with_a_decode_alive),
            "wrong_outputs": len(self.wrong),
            "unexpected_errors": len(self.unexpected),
            "leaked_blocks": self.leaked_blocks,
            "worst_time_to_final_s": round(self.worst_final_s, 2),
            "faults_injected": dict(sorted(self.faults.items())),
            "processes_died_unexpectedly": self.died,
            "lost_ids": self.lost, "wrong_ids": self.wrong, "unexpected": self.unexpected,
        }


class Soak:
    def __init__(self, rig: FaultRig, prompts: list[dict], reference: list[list[int]], seed: int = 0,
                 long_answer: int | None = None):
        self.rig = rig
        self.prompts = prompts
        self.long_answer = long_answer  # the prompt mid-stream kills use (not sent otherwise)
        self.reference = reference
        self.rng = random.Random(seed)
        self.tally = Tally()
        self._in_flight: dict[str, asyncio.Task] = {}

    async def run(self, seconds: float, rate: float, fault_every_s: float, progress=None,
                  at_least_faults: int = 0, most_seconds: float | None = None) -> Tally:
        """Send at ``rate`` for ``seconds``, a fault every ``fault_every_s``. With
        ``at_least_faults``, go on past ``seconds`` (to ``most_seconds`` at most) until that
        many faults, the first ones of FAULT_KINDS, have gone in: some faults take seconds
        themselves, and a slow machine would otherwise end before the last ones."""
        stop_at = time.monotonic() + seconds
        give_up_at = time.monotonic() + max(seconds, most_seconds or seconds)
        faults = asyncio.create_task(self._inject_faults(stop_at, fault_every_s, progress, at_least_faults, give_up_at))
        while time.monotonic() < stop_at or (not faults.done() and time.monotonic() < give_up_at):
            self._send()
            await asyncio.sleep(self.rng.expovariate(rate))
        await faults
        await asyncio.gather(*self._in_flight.values())
        self.rig.set_chaos(None)
        await self._settle()
        self.tally.faults.update({f"message_{kind}": n for kind, n in self.rig.injected().items()})
        return self.tally

    def _send(self) -> str:
        index = self.rng.randrange(len(self.prompts) - (self.long_answer is not None))  # it is the last
        request_id = f"soak-{uuid.uuid4().hex[:12]}"
        body = {**self.prompts[index], "request_id": request_id}
        self.tally.sent += 1
        self._in_flight[request_id] = asyncio.create_task(self._one(body, index))
        return request_id

    async def _one(self, body: dict, index: int, drop_final: bool = False, on_reply=None) -> None:
        request_id = body["request_id"]
        started = time.monotonic()
        try:
            outcome = await self.rig.request(body, on_reply, timeout=DEADLINE_S + 30, drop_final=drop_final)
        except TimeoutError:
            self.tally.lost.append(request_id)
            return
        except KvpushError as exc:  # refused before any scheduler took it (no_scheduler while NATS restarts)
            outcome = Outcome(request_id, [], wire.ErrorReply(request_id, to_error_body(exc)),
                              time.monotonic() - started)
        finally:
            self._in_flight.pop(request_id, None)
        self._record(outcome, index)

    def _record(self, outcome: Outcome, index: int) -> None:
        self.tally.worst_final_s = max(self.tally.worst_final_s, outcome.seconds)
        code = outcome.code
        self.tally.outcomes[code or "ok"] += 1
        if code is None and outcome.final.path is not None and outcome.final.path.migrations:
            self.tally.migrated += 1
        if code == "worker_lost" and self.rig.decodes > 1:
            self.tally.worker_lost_with_a_decode_alive.append(f"{outcome.request_id}: {outcome.final.error.message}")
        if code is None and outcome.tokens != self.reference[index]:
            self.tally.wrong.append(outcome.request_id)
        elif code is not None and code not in EXPECTED_CODES:
            self.tally.unexpected.append(f"{outcome.request_id}: {code}: {outcome.final.error.message}")

    async def _settle(self) -> None:
        try:
            await self.rig.assert_blocks_back(timeout=90)
        except AssertionError:
            pass
        for role in ("prefill", "decode"):
            live = self.rig.live_workers(role)
            # The engine that lost the most (one with none live: all it had at the start).
            self.tally.leaked_blocks[role] = max((self.rig.start_free[wid] - b.free for wid, b in live.items()),
                                                 default=max(self.rig.start_free.values(), default=0))
        for name, process in self.rig.stack.children:
            if name not in self.rig.killed and process.poll() is not None:
                self.tally.died.append(name)

    # ------------------------------------------------------------------ faults

    async def _inject_faults(self, stop_at: float, every_s: float, progress, at_least: int = 0,
                             give_up_at: float = 0.0) -> None:
        turn = 0
        while (time.monotonic() + every_s < stop_at
               or (turn < at_least and time.monotonic() + every_s < give_up_at)):
            await asyncio.sleep(every_s)
            kind = FAULT_KINDS[turn % len(FAULT_KINDS)]
            turn += 1
            if progress:
                progress(f"injecting {kind}")
            try:
                await getattr(self, f"_fault_{kind}")()
                self.tally.faults[kind] += 1
            except Exception as exc:  # a fault that could not be injected is reported, not fatal
                self.tally.faults[f"{kind}_not_injected"] += 1
                if progress:
                    progress(f"{kind} not injected: {type(exc).__name__}: {exc}")

    async def _fault_cancel(self) -> None:
        """Cancel a request in flight, wherever it is; or a new one, a moment after sending it."""
        if self._in_flight:
            request_id = self.rng.choice(list(self._in_flight))
        else:
            request_id = self._send()
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        await cancel(self.rig.conns["client"], request_id)

    async def _fault_client_gone(self) -> None:
        await self.rig.drop_reply_subscription({**self.prompts[5], "max_tokens": 300})

    async def _fault_malformed(self) -> None:
        await self.rig.send_malformed()

    async def _fault_forged_registration(self) -> None:
        await self.rig.forge_registration(self.prompts[6]["prompt_token_ids"])

    async def _fault_message_chaos(self) -> None:
        self.rig.set_chaos(MESSAGE_CHAOS)
        await asyncio.sleep(10)
        self.rig.set_chaos(None)

    async def _fault_kill_decode(self) -> None:
        await self.rig.kill_and_replace("decode")

    async def _fault_kill_decode_mid_stream(self) -> None:
        """kill -9 the decode streaming a long answer once its client has 1-100 tokens;
        with another decode alive the stream goes on there, token for token."""
        index = self.long_answer if self.long_answer is not None else len(self.prompts) - 1
        request_id = f"soak-midstream-{uuid.uuid4().hex[:12]}"
        after = self.rng.randint(1, 100)
        counted = asyncio.Event()
        received = 0

        async def on_reply(reply) -> None:
            nonlocal received
            if isinstance(reply, wire.TokenChunk):
                received += len(reply.token_ids)
                if received >= after:
                    counted.set()

        self.tally.sent += 1
        task = asyncio.create_task(self._one({**self.prompts[index], "request_id": request_id}, index,
                                             on_reply=on_reply))
        self._in_flight[request_id] = task
        await asyncio.wait_for(counted.wait(), timeout=120)
        name = self.rig.streaming_on[request_id]
        old = self.rig.live_incarnations("decode")
        self.rig.kill_worker(name)
        self.rig.replace("decode", name)
        await self.rig.wait_for_new_worker("decode", old)

    async def _fault_kill_prefill(self) -> None:
        await self.rig.kill_and_replace("prefill")

    async def _fault_nats_restart(self) -> None:
        self.rig.nats.restart()

    async def _fault_nats_outage(self) -> None:
        """NATS down for longer than the worker timeout: nobody may be declared lost for it."""
        await asyncio.to_thread(self.rig.nats.restart_after, NATS_OUTAGE_S)

    async def _fault_kill_scheduler(self) -> None:
        """kill -9 one of the two schedulers; the other takes its requests over."""
        victim = self.rng.choice(sorted(self.rig.SCHEDULER_PROCESSES))
        self.rig.kill_scheduler(victim)
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        await self.rig.restart_scheduler(victim)

    async def _fault_kill_scheduler_validating(self) -> None:
        """kill -9 a scheduler while a request is in its tokenizer (held there): the request
        was taken but not yet written down; another scheduler's copy of it must be served."""
        self.rig.hold("scheduler.validating")
        try:
            await self.rig.wait_held("scheduler.validating", timeout=30)
            pid = self.rig.held_pids("scheduler.validating")[0]
            victim = next(sid for sid, name in self.rig.SCHEDULER_PROCESSES.items()
                          if dict(self.rig.stack.children)[name].pid == pid)
            self.rig.kill_pid(pid)
        finally:
            self.rig.release()
        await self.rig.restart_scheduler(victim)

    async def _fault_fenced_decode(self) -> None:
        """Stall the decode (SIGSTOP) past the worker timeout: its requests are fenced and
        retried; once it runs again it must send nothing for a fenced attempt."""
        name = next(name for name, _ in self.rig.stack.children if name.startswith("decode"))
        self.rig.pause(name)
        try:
            await asyncio.sleep(FENCED_PAUSE_S)
        finally:
            self.rig.resume(name)

    async def _fault_dropped_final(self) -> None:
        """A request whose final the client drops: it must fetch it again (kvpush.final)."""
        index = self.rng.randrange(len(self.prompts))
        request_id = f"soak-dropped-{uuid.uuid4().hex[:12]}"
        self.tally.sent += 1
        task = asyncio.create_task(self._one({**self.prompts[index], "request_id": request_id}, index,
                                             drop_final=True))
        self._in_flight[request_id] = task


def markdown(report: dict) -> str:
    rows = [
        ("requests sent", report["requests_sent"]),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))),
        ("requests lost", report["requests_lost"]),
        ("answers continued on another decode mid-stream", report.get("migrated", 0)),
        ("worker_lost while another decode was alive", report.get("worker_lost_with_a_decode_alive", 0)),
        ("wrong outputs", report["wrong_outputs"]),
        ("unexpected errors", report["unexpected_errors"]),
        ("leaked KV blocks", ", ".join(f"{k} {v}" for k, v in report["leaked_blocks"].items())),
        ("worst time to a final message", f"{report['worst_time_to_final_s']} s"),
        ("processes that died unexpectedly", len(report["processes_died_unexpectedly"])),
    ]
    faults = ", ".join(f"{k} {v}" for k, v in report["faults_injected"].items())
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), f"| faults injected | {faults} |"]
    return "\n".join(lines)


async def run_soak(model: str, minutes: float, rate: float, out: Path, fault_every_s: float, seed: int,
                   max_model_len: int = settings.MAX_MODEL_LEN, progress=print, decodes: int = 2) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    prompts = soak_prompts(seed)
    progress("computing the reference outputs on a plain vLLM instance")
    reference = reference_outputs(model, prompts, out, max_model_len)
    rig = FaultRig(out / "rig", model, max_model_len, decodes=decodes)
    progress(f"starting the fault rig (NATS with TLS and per-role users, two schedulers, a prefill, {decodes} decodes)")
    started = time.monotonic()
    try:
        await rig.start()
        progress(f"soaking for {minutes:g} min at {rate:g} req/s, a fault every {fault_every_s:g} s")
        soak = Soak(rig, prompts, reference, seed, long_answer=len(prompts) - 1)
        begun = time.monotonic()
        tally = await soak.run(minutes * 60, rate, fault_every_s, progress)
        report = tally.as_dict(time.monotonic() - begun, rate)
    finally:
        await rig.stop()
    report["wall_s"] = round(time.monotonic() - started, 1)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    (out / "soak.md").write_text(markdown(report) + "\n")
    return report


def cmd(args) -> int:
    """``kvpush soak``."""
    report = asyncio.run(run_soak(
        model_path(args), args.minutes, args.rate, Path(args.out), args.fault_every_s, args.seed,
        progress=say))
    print(markdown(report))
    say(f"results in {args.out}/soak.json")
    clean = not (report["requests_lost"] or report["wrong_outputs"] or report["unexpected_errors"]
                 or report.get("worker_lost_with_a_decode_alive") or any(report["leaked_blocks"].values())
                 or report["processes_died_unexpectedly"])
    return 0 if clean else 1
