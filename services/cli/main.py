"""The ``kvpush`` command: the parser; each command lives in serve, requests or tools."""

from __future__ import annotations

import argparse
import sys

from services.cli import requests, serve, tools
from services.cli import settings as cli_settings


# ------------------------------------------------------------------ parser

def build_parser() -> argparse.ArgumentParser:
    from shared import nats_security

    parser = argparse.ArgumentParser(prog="kvpush", description="Disaggregated LLM serving with pushed KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="manage the built-in model").add_subparsers(dest="model_command", required=True)
    build = model.add_parser("build", help="build the small offline model (deterministic)")
    build.add_argument("--profile", default="small", choices=["small", "kv-heavy"])
    build.add_argument("--out", help="folder (default: ~/.cache/kvpush/models/<profile>)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true")
    build.set_defaults(func=tools.cmd_model_build)

    def nats_options(p, **nats_default):
        cli_settings.add(p, "--nats-url", **nats_default)
        nats_security.add_arguments(p)

    def engine_options(p, **nats_default):
        nats_options(p, **nats_default)
        cli_settings.add(p, "--model", "--max-model-len")

    def stack_options(p):
        engine_options(p, nats_url=None)  # default: start a local NATS server
        cli_settings.add(p, "--mode", "--connector", "--prefix-caching")
        p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
        p.add_argument("--decode", type=int, default=1, help="number of decode workers")
        p.add_argument("--ready-timeout", type=float, default=600.0)
        p.add_argument("--gateway-port", type=int, default=8000,
                       help="the OpenAI-compatible HTTP gateway's port on 127.0.0.1 (a free one if taken; -1: none)")

    up = sub.add_parser("up", help="start NATS (unless --nats-url), a scheduler, workers and the gateway, all on "
                                   "127.0.0.1 only (NATS without users or TLS: for this machine; compose.yaml "
                                   "and deploy/ secure it for more); Ctrl-C stops")
    stack_options(up)
    up.set_defaults(func=serve.cmd_up)

    demo = sub.add_parser("demo", help="start the stack, stream a few requests through NATS, stop")
    stack_options(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=serve.cmd_demo)

    scheduler = sub.add_parser("scheduler", help="run one scheduler")
    engine_options(scheduler)
    cli_settings.add(scheduler, "--mode", "--local-below-tokens", "--push-within-s", "--log-level", "--metrics-port", "--metrics-host", "--deadline-s", "--worker-timeout-s", "--max-in-flight",
                     "--scheduler-timeout-s", "--jetstream-replicas")
    scheduler.add_argument("--scheduler-id", help="default: the NATS user (--nats-user), else scheduler-<random>")
    scheduler.set_defaults(func=serve.cmd_scheduler)

    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (/v1/completions, "
                                            "/v1/chat/completions, /v1/models, /health, /ready)")
    engine_options(gateway)
    cli_settings.add(gateway, "--log-level", "--api-key", "--api-keys-file", "--max-concurrent-per-key",
                     "--rate-per-key", "--burst-per-key")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--served-model-name", help="the model name clients send (default: the model folder's name)")
    gateway.set_defaults(func=serve.cmd_gateway)

    worker = sub.add_parser("worker", help="run one prefill or decode worker")
    engine_options(worker)
    worker.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker.add_argument("--worker-id", help="default: the NATS user (--nats-user), else <role>-<random>; a restart "
                                            "keeps the id and gets a new incarnation")
    cli_settings.add(worker, "--connector", "--prefix-caching", "--log-level", "--metrics-port", "--metrics-host", "--lease-s", "--kv-wait-s", "--quarantine-s",
                     "--on-kv-failure")
    worker.set_defaults(func=serve.cmd_worker)

    generate = sub.add_parser("generate", help="send one request to kvpush.generate and stream the reply")
    generate.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    nats_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--token-ids", action="store_true", help="the prompt is a list of token ids")
    generate.set_defaults(func=requests.cmd_generate)

    cancel = sub.add_parser("cancel", help="cancel a request by its request id, wherever it is")
    cancel.add_argument("request_id")
    nats_options(cancel)
    cancel.set_defaults(func=requests.cmd_cancel)

    bench = sub.add_parser("bench", help="kvpush push/pull against vLLM's own disaggregated serving, one client "
                                         "(vllm bench serve) for all")
    bench.add_argument("--systems", default="kvpush-push,kvpush-pull,vllm-nixl,vllm-nixl-push")
    bench.add_argument("--input-lens", help="one workload per prompt length instead of the built-in grid")
    bench.add_argument("--rates", default="1", help="with --input-lens: arrival rates in req/s (Poisson)")
    bench.add_argument("--requests", type=int, default=16, help="with --input-lens: measured requests per point")
    bench.add_argument("--prefill", type=int, default=1, help="with --input-lens: prefill engines per system")
    bench.add_argument("--decode", type=int, default=1, help="with --input-lens: decode engines per system")
    bench.add_argument("--range-ratio", type=float, default=0.0,
                       help="with --input-lens: prompt lengths uniform in len * [1 - r, 1 + r]")
    bench.add_argument("--burstiness", type=float, default=1.0, help="with --input-lens: 1 Poisson, lower bursts")
    bench.add_argument("--background", type=int, default=0,
                       help="with --input-lens: long generations sent at each point's start, beside it")
    bench.add_argument("--background-output-len", type=int, default=1024)
    bench.add_argument("--binding", help="system=auto|split|all,... (default: each system's best, measured)")
    bench.add_argument("--try-bindings", default="auto,split,all", help="the bindings the probe tries")
    bench.add_argument("--probe-requests", type=int, help="requests of the binding probe point (default 4)")
    bench.add_argument("--no-raw-nixl", action="store_true", help="skip the raw NIXL bandwidth measurement")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--profile", default="kv-heavy", choices=["small", "kv-heavy"])
    bench.add_argument("--model", help="a local model folder instead of a built-in profile")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(func=tools.cmd_bench)

    soak = sub.add_parser("soak", help="requests under every kind of fault for a while; then what was lost, "
                                       "wrong or leaked (nothing, or exit 1)")
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson arrivals)")
    soak.add_argument("--fault-every-s", type=float, default=20.0, help="one fault, of each kind in turn, this often")
    soak.add_argument("--model", help="a local model folder (default: the built-in small model)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", default="soak-results")
    soak.set_defaults(func=tools.cmd_soak)

    multiturn = sub.add_parser("bench-multiturn", help="closed-loop conversations (each turn appends to the last) "
                                                       "against kvpush with prefix caching on and off")
    multiturn.add_argument("--conversations", type=int, default=6)
    multiturn.add_argument("--turns", type=int, default=4)
    multiturn.add_argument("--first-len", type=int, default=1024, help="tokens of each conversation's opening")
    multiturn.add_argument("--turn-len", type=int, default=128, help="new tokens of each later turn")
    multiturn.add_argument("--output-len", type=int, default=32)
    multiturn.add_argument("--concurrency", type=int, default=2, help="conversations at once")
    multiturn.add_argument("--systems", default="kvpush-push",
                           help="kvpush-push|pull|auto|local and vllm-nixl|vllm-nixl-push, comma-separated")
    multiturn.add_argument("--prefill", type=int, default=1)
    multiturn.add_argument("--decode", type=int, default=1)
    multiturn.add_argument("--max-model-len", type=int, default=4096)
    multiturn.add_argument("--profile", default="kv-heavy", choices=["small", "kv-heavy"])
    multiturn.add_argument("--model", help="a local model folder instead of a built-in profile")
    multiturn.add_argument("--seed", type=int, default=0)
    multiturn.add_argument("--out", default="bench-results/multiturn")
    multiturn.set_defaults(func=tools.cmd_bench_multiturn)

    from tools.bench import scheduler_rate

    bench_scheduler = sub.add_parser("bench-scheduler", help="one real scheduler's request rate against idle "
                                                             "stand-in workers (real nats-server and client)")
    scheduler_rate.add_arguments(bench_scheduler)
    bench_scheduler.set_defaults(func=scheduler_rate.cmd)

    bench_transfer = sub.add_parser("bench-transfer", help="our transfer thread vs a raw NIXL WRITE, 1-256 MiB")
    bench_transfer.add_argument("--out", help="write the rows as JSON here")
    bench_transfer.set_defaults(func=tools.cmd_bench_transfer)

    status = sub.add_parser("status", help="ask the scheduler which workers it routes to; exit 1 if too few")
    nats_options(status)
    status.add_argument("--min-prefill", type=int, default=0)
    status.add_argument("--min-decode", type=int, default=0)
    status.add_argument("--timeout", type=float, default=2.0)
    status.add_argument("--http", metavar="URL", help="instead, ask a gateway or service: exit 0 if URL answers 200 "
                                                      "(e.g. http://127.0.0.1:8000/health)")
    status.set_defaults(func=requests.cmd_status)

    nats_config = sub.add_parser("nats-config", help="write a nats-server config with one NATS user per worker, "
                                                     "scheduler and client, each allowed only its own subjects")
    for flag, default in (("--schedulers", "scheduler-0"), ("--prefill", "prefill-0"), ("--decode", "decode-0"),
                          ("--clients", "client-0")):
        nats_config.add_argument(flag, default=default, help=f"comma-separated names (default {default})")
    nats_config.add_argument("--passwords", choices=["env", "random"], default="env",
                             help="env: the server reads $NATS_PASSWORD_<NAME> from its environment; random: "
                                  "new passwords written into the config (and to --passwords-out)")
    nats_config.add_argument("--passwords-out", help="with --passwords random: write NAME=PASSWORD lines here")
    nats_config.add_argument("--tls-dir", default="certs", metavar="DIR",
                             help="the folder with server.pem, server-key.pem and ca.pem, for mutual TLS (default "
                                  "./certs; `python -m tools.dev_certs DIR` makes development ones)")
    nats_config.add_argument("--no-tls", action="store_true",
                             help="write no TLS block, so passwords and data cross the network in the clear: only "
                                  "where something else encrypts every connection (a service mesh's mutual TLS, a "
                                  "tunnel) or nothing leaves the machine")
    nats_config.add_argument("--listen", metavar="HOST", default="127.0.0.1",
                             help="the address the server binds (default 127.0.0.1: this machine only; 0.0.0.0 for "
                                  "every interface, so that workers on other hosts can connect)")
    nats_config.add_argument("--port", type=int, default=4222)
    for flag, dest, kind, what in (
            ("--js-max-memory", "max_memory", str, "bytes in memory-backed streams (kvpush keeps none; default 0)"),
            ("--js-max-file", "max_file", str, "bytes in file-backed streams, once per replica (default: what "
                                               "kvpush reserves for these identities at three replicas, + 1 GiB)"),
            ("--js-max-streams", "max_streams", int, "streams in the account (default: three, one per decode, "
                                                     "and four more)"),
            ("--js-max-consumers", "max_consumers", int, "consumers on any one stream (default 64)")):
        nats_config.add_argument(flag, dest=f"js_{dest}", type=kind, default=None,
                                 metavar="SIZE" if kind is str else "N",
                                 help=f"JetStream limit of kvpush's account: {what}")
    nats_config.add_argument("--out", help="the config file (default: standard output)")
    nats_config.add_argument("--sample", action="store_true", help="print deploy/nats-server.conf and stop")
    nats_config.set_defaults(func=tools.cmd_nats_config)

    trace = sub.add_parser("trace", help="show where a request's time went, from the local span files")
    trace.add_argument("request_id", nargs="?")
    trace.add_argument("--summary", action="store_true", help="TTFT split across all recorded requests")
    trace.add_argument("--dir", help="span folder (default: $KVPUSH_TRACE_DIR or ~/.cache/kvpush/traces)")
    trace.set_defaults(func=tools.cmd_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    from shared.nats_security import NatsConfigError, connect_options, export_arguments

    args = build_parser().parse_args(argv)
    export_arguments(args)  # children (vLLM's engine core, the stack's services) read them from there
    try:
        connect_options()
    except NatsConfigError as exc:
        print(f"kvpush: {exc}", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
