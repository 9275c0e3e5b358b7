"""The benchmarks' commands (``kvpush bench``, ``bench-multiturn``, ``bench-scheduler``,
``bench-transfer``), added to ``kvpush`` through the ``kvpush.commands`` entry points
(pyproject.toml). Parsers only: each command's function, in its own module, is imported
when it runs."""

from __future__ import annotations

import argparse

from kvpush.services.cli.commands import lazy
from kvpush.shared import settings

BLOCK_SIZE = 16  # bench-scheduler's stand-ins: tokens per KV block, vLLM's default on GPUs (its CPU platform's is 128)


def _dilation(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number (k) or auto") from None


def _model_arguments(parser, out: str) -> None:
    """The model the engines serve (a built-in profile, or a folder), the prompts' seed, and
    the results' folder: the same for every benchmark that starts engines."""
    parser.add_argument("--profile", default="kv-heavy", choices=["small", "kv-heavy"])
    parser.add_argument("--model", help="a local model folder instead of a built-in profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out)


def _link_argument(parser, help: str) -> None:
    """How emulated engines reach each other: ``kvpush.tools.emulation.link``'s two ways."""
    parser.add_argument("--link", choices=["shaped", "loopback"], default="shaped", help=help)


def register_bench(sub) -> None:
    bench = sub.add_parser("bench", help="kvpush push/pull against vLLM's own disaggregated serving, one client "
                                         "(vllm bench serve) for all")
    bench.add_argument("--systems", default="kvpush-push,kvpush-pull,vllm-nixl,vllm-nixl-push")
    bench.add_argument("--input-lens", help="one workload per prompt length instead of the built-in grid")
    bench.add_argument("--rates", default="1", help="with --input-lens: arrival rates in req/s (Poisson)")
    bench.add_argument("--requests", type=int, default=16, help="with --input-lens: measured requests per point")
    bench.add_argument("--prefill", type=int, default=1, help="with --input-lens: prefill engines per system")
    bench.add_argument("--decode", type=int, default=1, help="with --input-lens: decode engines per system")
    bench.add_argument("--prefill-tp", type=int, default=1,
                       help="tensor parallelism of every prefill engine, kvpush's and vllm serve's alike")
    bench.add_argument("--decode-tp", type=int, default=1, help="tensor parallelism of every decode engine")
    bench.add_argument("--max-num-seqs", type=int, default=0,
                       help="requests every engine runs at once, kvpush's and vllm serve's alike (0: each its own "
                            "default, kvpush 16, vllm serve 128 on CPUs)")
    bench.add_argument("--block-size", type=int, default=0,
                       help="tokens per KV block of every engine, kvpush's and vllm serve's alike (0: vLLM's "
                            "default, 128 on CPUs; its CPU attention takes multiples of 32, GPUs default to 16)")
    bench.add_argument("--range-ratio", type=float, default=0.0,
                       help="with --input-lens: prompt lengths uniform in len * [1 - r, 1 + r]")
    bench.add_argument("--burstiness", type=float, default=1.0, help="with --input-lens: 1 Poisson, lower bursts")
    bench.add_argument("--prefix-len", type=int, default=0,
                       help="with --input-lens: tokens every prompt shares at its start, within its length "
                            "(vllm bench serve's --random-prefix-len; the published push-vs-pull table used 50 of 512)")
    bench.add_argument("--background", type=int, default=0,
                       help="with --input-lens: long generations sent at each point's start, beside it")
    bench.add_argument("--background-output-len", type=int, default=1024)
    bench.add_argument("--binding", help="system=auto|split|all,... (default: each system's best, measured)")
    bench.add_argument("--try-bindings", default="auto,split,all", help="the bindings the probe tries")
    bench.add_argument("--probe-requests", type=int, help="requests of the binding probe point (default 4)")
    bench.add_argument("--no-raw-nixl", action="store_true", help="skip the raw NIXL bandwidth measurement")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--push-by-layer", choices=["on", "off", "auto"], default=settings.PUSH_BY_LAYER,
                       help="kvpush's prefill workers write each layer's KV as the forward finishes it")
    bench.add_argument("--point-timeout", type=float, default=1800.0,
                       help="seconds a point's client may take; past it the point failed (and is tried once more "
                            "on a fresh start of its system)")
    bench.add_argument("--repeats", type=int, default=1,
                       help="measure each point this many times in a row, fresh prompts each time: its noise")
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--at-rest-s", type=float, default=5.0,
                       help="seconds over which each system's CPU at rest (no request, after its start) is measured, "
                            "per process and per vLLM engine process (EngineCore, Worker_TP<rank>)")
    bench.add_argument("--sampling-flags", default="",
                       help="vllm bench serve's sampling flags for every point, e.g. \"--temperature 0.7 --top-p 0.9\" "
                            "(default: none, its own defaults)")
    _model_arguments(bench, out="bench-results")
    emulated = bench.add_argument_group("emulated GPUs (docs/benchmarks.md, \"Emulated GPUs\")")
    emulated.add_argument("--emulate", metavar="MODEL@GPU",
                          help="every engine runs the timed model of this deployment (qwen3-32b@p5en, "
                               "llama-3.1-8b@h100); without --input-lens, the seed's grid")
    emulated.add_argument("--dilation", type=_dilation, default="auto",
                          help="k: every modeled time and every arrival gap is k times longer; results are "
                               "reported divided by k. auto (the default): each workload's own, from its longest "
                               "prompt, so that the forwards' real work stays a small share")
    emulated.add_argument("--workloads", metavar="NAME[@RATE],...",
                          help="measure only these of the grid (1k, 4k, 8k, 16k, '4k 1P2D', '4k 2P1D', "
                               "'mixed 200-16k'; 8k@4 for one rate), e.g. the seed's most demanding points first "
                               "and the rest later with --resume into the same --out. Without --emulate: of the "
                               "CPU grid and its longer inputs (8k, 16k, outside the default grid)")
    emulated.add_argument("--resume", action="store_true",
                          help="keep the points already in --out and measure only the others (each point is "
                               "written as it ends)")
    emulated.add_argument("--nixl-progress-thread", choices=["on", "paced"], default="paced",
                          help="vLLM's NIXL agents' progress thread: NIXL's own (spins a core at rest) or "
                               "paced (1 ms between rounds)")
    _link_argument(emulated, "each engine on a network-namespace host of its own, NIXL over UCX TCP through a "
                             "link shaped to the deployment's (root only), or all on loopback")
    emulated.add_argument("--forward", choices=["network", "stand-in"], default="network",
                          help="what an emulated engine computes: the tiny timed network (network), or nothing "
                               "(stand-in: a KV pattern written and read back, tokens a function of the KV read; "
                               "host costs at full weight at k = 1)")
    emulated.add_argument("--pacing", choices=["layers", "every-layer", "step"], default="layers",
                          help="the timed model's waits: by layer in steps with prompt tokens and once in "
                               "decode-only steps (layers), by layer always, or once per step")
    bench.set_defaults(func=lazy("kvpush.tools.bench.run:cmd"))


def register_multiturn(sub) -> None:
    multiturn = sub.add_parser("bench-multiturn", help="closed-loop conversations (each turn appends to the last) "
                                                       "against kvpush with prefix caching on and off")
    multiturn.add_argument("--conversations", type=int, default=6)
    multiturn.add_argument("--turns", type=int, default=4)
    multiturn.add_argument("--first-len", type=int, default=1024, help="tokens of each conversation's opening")
    multiturn.add_argument("--turn-len", type=int, default=128, help="new tokens of each later turn")
    multiturn.add_argument("--output-len", type=int, default=32)
    multiturn.add_argument("--concurrency", type=int, default=2, help="conversations at once")
    multiturn.add_argument("--think-s", type=float, default=0.0,
                           help="mean pause before each next turn (exponential, at most 4x): conversations drift "
                                "apart, so a turn often meets load away from its history")
    multiturn.add_argument("--fetch", choices=["on", "off", "both"], default="both",
                           help="kvpush's prefix fetching in the runs with prefix caching on")
    multiturn.add_argument("--systems", default="kvpush-push",
                           help="kvpush-push|pull|auto|local and vllm-nixl|vllm-nixl-push, comma-separated")
    multiturn.add_argument("--prefill", type=int, default=1)
    multiturn.add_argument("--decode", type=int, default=1)
    multiturn.add_argument("--max-model-len", type=int, default=4096)
    _model_arguments(multiturn, out="bench-results/multiturn")
    multiturn.add_argument("--emulate", metavar="MODEL@GPU",
                           help="every engine runs the timed model of this deployment (qwen3-32b@p5en, "
                                "llama-3.1-8b@h100); times reported in emulated time")
    multiturn.add_argument("--dilation", type=_dilation, default="auto",
                           help="k: every modeled time and think time is k times longer (auto: from the longest prompt)")
    _link_argument(multiturn, "emulated: each engine on a host of its own behind a link shaped to the "
                              "deployment's (root only), or all on loopback")
    multiturn.set_defaults(func=lazy("kvpush.tools.bench.multiturn_run:cmd"))


def register_scheduler_rate(sub) -> None:
    bench_scheduler = sub.add_parser("bench-scheduler", help="one real scheduler's request rate against idle "
                                                             "stand-in workers (real nats-server and client)")
    scheduler_rate_arguments(bench_scheduler)
    bench_scheduler.set_defaults(func=lazy("kvpush.tools.bench.scheduler_rate:cmd"))


def register_transfer(sub) -> None:
    bench_transfer = sub.add_parser("bench-transfer", help="our transfer thread vs a raw NIXL WRITE, 1-256 MiB")
    bench_transfer.add_argument("--out", help="write the rows as JSON here")
    bench_transfer.set_defaults(func=lazy("kvpush.tools.bench.transfer:cmd"))


def scheduler_rate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per point (after the warm-up)")
    parser.add_argument("--concurrency", default="1,16,64", help="requests in flight, comma-separated: one point each")
    parser.add_argument("--topologies", default="1P1D,8P8D", help="stand-in workers, comma-separated: one point each")
    parser.add_argument("--time-limit-s", type=float, default=60.0,
                        help="no request starts after this many seconds of a point's load")
    parser.add_argument("--request-timeout-s", type=float, default=30.0, help="a request silent this long failed")
    parser.add_argument("--warmup", type=int, default=50, help="requests before each point's measurement")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens of every prompt (random ids)")
    parser.add_argument("--output-tokens", type=int, default=1, help="tokens of every answer, one chunk each")
    parser.add_argument("--count-subjects", action="store_true",
                        help="count every message and byte by subject (a subscriber on >; slows the bench itself)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="the stand-ins' KV block size (vLLM's default: 16 on GPUs, 128 on its CPU platform)")
    parser.add_argument("--schedulers", type=int, default=1,
                        help="schedulers sharing the load (a queue group); CPU is summed over them")
    parser.add_argument("--scheduler-quiet", action="store_true",
                        help="run the scheduler with WARNING logs and OpenTelemetry off (default: as it ships)")
    parser.add_argument("--detail", action="store_true", help="keep every request (prompt, tokens, final) in the JSON")
    parser.add_argument("--model", help="a model folder for the scheduler's validator (default: the small model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-results/scheduler", help="folder for scheduler_rate.json")
    parser.add_argument("--name", default="scheduler_rate", help="the result file's name, without .json")
