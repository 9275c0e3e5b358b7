"""Mid-stream migration, the full matrix by hand (CI runs one kill per mode:
tests/stack/test_moves.py). On a 1P2D fault rig: the decode streaming a request is killed
(kill -9) or its engine stopped (SIGSTOP, its worker heartbeating) once the client has
1, 10 and 100 tokens, in push, pull and local, greedy and seeded (the two in one break);
then the client-visible pause at a break, at 1k and 4k prompts.

    python -m kvpush.tools.reliability.migration_matrix --out DIR [--pauses 5]

Each broken stream is checked as the stack test checks it: seq contiguous, one final
counting every chunk, one migration, and its tokens against the single engine's: greedy,
the continuation of a local request whose prompt is the prompt plus the tokens sent
(and, reported, whether that equals the uninterrupted output); seeded, the uninterrupted
output itself. Writes ``DIR/migration.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.shared import wire
from kvpush.tools.reliability.fault_rig import running_rig, wait_until

SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}
DECODES = ("decode-0", "decode-1")


@dataclass
class Broken:
    """One request whose stream broke, as its client saw it."""

    fault: str
    mode: str
    sampling: str
    prompt_tokens: int
    asked_after: int
    body: dict
    tokens: list[int] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # each chunk's (monotonic)
    received: list[int] = field(default_factory=list)  # tokens the client had after each chunk
    final: object = None
    resumed_after: int = 0
    pause_s: float = 0.0
    ok: bool = False
    equals_uninterrupted: bool | None = None
    problem: str = ""

    async def on_reply(self, reply) -> None:
        if isinstance(reply, wire.TokenChunk):
            self.seqs.append(reply.seq)
            self.tokens.extend(reply.token_ids)
            self.arrivals.append(time.monotonic())
            self.received.append(len(self.tokens))

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items()
                if k not in ("body", "tokens", "seqs", "arrivals", "received", "final")}


def _body(mode: str, length: int, seed: int, max_tokens: int, sampling: dict) -> dict:
    rng = random.Random(seed)
    return {"request_id": f"matrix-{time.monotonic_ns()}", "transfer_mode": mode, "max_tokens": max_tokens,
            "prompt_token_ids": [rng.randrange(1, 4096) for _ in range(length)], **sampling}


async def _break(rig, fault: str, decode: str, cases: list[Broken]) -> None:
    """Stream ``cases`` on ``decode`` (the other stopped meanwhile), break it once each
    client has its tokens, and wait for every final."""
    other = next(name for name in DECODES if name != decode)
    rig.pause(other)
    try:
        await wait_until(lambda: other not in rig.live_workers("decode", within_s=3.2), 15, f"{other} silent")
        await asyncio.sleep(1.0)
        tasks = [asyncio.create_task(rig.request(c.body, on_reply=c.on_reply, timeout=300)) for c in cases]
        await wait_until(lambda: all(len(c.tokens) >= c.asked_after for c in cases) or any(t.done() for t in tasks),
                         180, "the tokens in")
        if fault == "kill":
            rig.kill_worker(decode)
        else:
            rig.pause_engine(decode)
    finally:
        rig.resume(other)
    outcomes = await asyncio.gather(*tasks)
    if fault == "stall":
        rig.resume_engine(decode)
    for case, outcome in zip(cases, outcomes):
        case.final = outcome.final


async def _check(rig, case: Broken) -> None:
    final = case.final
    if not isinstance(final, wire.FinalReply):
        case.problem = f"ended with {final}"
        return
    path = final.path
    if case.seqs != list(range(len(case.seqs))) or final.chunks != len(case.seqs):
        case.problem = "seq not contiguous, or the final's count differs"
    elif path.migrations != 1:
        case.problem = f"{path.migrations} migrations (it ended before the break?)"
        return
    case.resumed_after = path.resumed_after[0]
    last_before = case.received.index(case.resumed_after)  # the chunk that ended what the client had
    case.pause_s = case.arrivals[last_before + 1] - case.arrivals[last_before]
    again = await rig.request({**case.body, "request_id": f"again-{time.monotonic_ns()}"}, timeout=300)
    case.equals_uninterrupted = again.tokens == case.tokens
    if case.sampling == "seeded":
        case.ok = case.equals_uninterrupted and not case.problem
        return
    k = case.resumed_after
    reference = await rig.request({**case.body, "request_id": f"ref-{time.monotonic_ns()}", "transfer_mode": "local",
                                   "prompt_token_ids": case.body["prompt_token_ids"] + case.tokens[:k],
                                   "max_tokens": case.body["max_tokens"] - k}, timeout=300)
    case.ok = reference.tokens == case.tokens[k:] and not case.problem


async def run(out: Path, pauses: int) -> dict:
    model = str(build_model(default_model_dir("small")))
    env = {"KVPUSH_LEASE_S": "20", "KVPUSH_QUARANTINE_S": "25", "KVPUSH_STALL_S": "5"}
    done: list[Broken] = []
    async with running_rig(out / "rig", model, 4608, decodes=2, extra_env=env) as rig:
        turn = 0
        for fault in ("kill", "stall"):
            for mode in ("push", "pull", "local"):
                for after in (1, 10, 100):
                    decode = DECODES[turn % 2]
                    turn += 1
                    cases = [Broken(fault, mode, kind, 512, after, _body(mode, 512, 100 + turn, after + 140, sampling))
                             for kind, sampling in (("greedy", {}), ("seeded", SEEDED))]
                    old = rig.live_incarnations("decode")
                    await _break(rig, fault, decode, cases)
                    if fault == "kill":
                        rig.replace("decode", decode)
                    for case in cases:
                        await _check(rig, case)
                        print(json.dumps(case.report()), flush=True)
                    done.extend(cases)
                    if fault == "kill":
                        await rig.wait_for_new_worker("decode", old)
        for length in (1024, 4096):
            for i in range(pauses):
                decode = DECODES[turn % 2]
                turn += 1
                case = Broken("stall", "push", "greedy", length, 10, _body("push", length, 500 + turn, 60, {}))
                await _break(rig, "stall", decode, [case])
                await _check(rig, case)
                print(json.dumps(case.report()), flush=True)
                done.append(case)
        await rig.assert_blocks_back(timeout=90)
    return summary(done)


def summary(done: list[Broken]) -> dict:
    matrix = [c for c in done if c.prompt_tokens == 512]
    greedy = [c for c in matrix if c.sampling == "greedy"]
    pause = {}
    for length in (512, 1024, 4096):
        for fault in ("kill", "stall"):
            gaps = sorted(c.pause_s for c in done if c.prompt_tokens == length and c.fault == fault and c.ok)
            if gaps:
                pause[f"{fault}_{length}"] = {"n": len(gaps), "p50_s": round(statistics.median(gaps), 3),
                                              "p99_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3)}
    return {"cases": [c.report() for c in done], "matrix_ok": sum(c.ok for c in matrix), "matrix": len(matrix),
            "greedy_equals_uninterrupted": sum(bool(c.equals_uninterrupted) for c in greedy), "greedy": len(greedy),
            "pause": pause}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pauses", type=int, default=5, help="stalls at each of 1k and 4k for the pause figures")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(out, args.pauses))
    (out / "migration.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}, indent=1))


if __name__ == "__main__":
    main()
