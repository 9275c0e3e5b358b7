"""The services' commands' parsers, one function each; each command's function is in
serve, requests or tools, imported when it runs (``kvpush.services.cli.commands.lazy``)."""

from __future__ import annotations

from kvpush.services.cli import settings as cli_settings
from kvpush.services.cli.commands import Register, lazy
from kvpush.services.launch.model import PROFILES
from kvpush.shared import nats_security


def nats_options(p, **nats_default) -> None:
    cli_settings.add(p, "--nats-url", **nats_default)
    nats_security.add_arguments(p)


def engine_options(p, **nats_default) -> None:
    nats_options(p, **nats_default)
    cli_settings.add(p, "--model", "--max-model-len")


def stack_options(p) -> None:
    engine_options(p, nats_url=None)  # default: start a local NATS server
    cli_settings.add(p, "--mode", "--connector", "--prefix-caching", "--block-size", "--max-num-seqs")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor parallelism of each prefill worker's engine")
    p.add_argument("--decode-tp", type=int, default=1, help="tensor parallelism of each decode worker's engine")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--gateway-port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP gateway's port on 127.0.0.1 (a free one if taken; -1: none)")


def add_model(sub) -> None:
    model = sub.add_parser("model", help="manage the built-in model").add_subparsers(dest="model_command", required=True)
    build = model.add_parser("build", help="build the small offline model (deterministic)")
    build.add_argument("--profile", default="small", choices=list(PROFILES))
    build.add_argument("--out", help="folder (default: ~/.cache/kvpush/models/<profile>)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true")
    build.set_defaults(func=lazy("kvpush.services.cli.tools:cmd_model_build"))


def add_up(sub) -> None:
    up = sub.add_parser("up", help="start NATS (unless --nats-url), a scheduler, workers and the gateway, all on "
                                   "127.0.0.1 only (NATS without users or TLS: for this machine; compose.yaml "
                                   "and deploy/ secure it for more); Ctrl-C stops")
    stack_options(up)
    up.set_defaults(func=lazy("kvpush.services.cli.serve:cmd_up"))


def add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="start the stack, stream a few requests through NATS, stop")
    stack_options(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=lazy("kvpush.services.cli.serve:cmd_demo"))


def add_scheduler(sub) -> None:
    scheduler = sub.add_parser("scheduler", help="run one scheduler")
    engine_options(scheduler)
    cli_settings.add(scheduler, "--mode", "--kv-policy", "--kv-checksums", "--max-migrations", "--stall-s", "--prefix-fetch", "--fetch-link-gbps", "--local-below-tokens", "--push-within-s", "--log-level", "--metrics-port", "--metrics-host", "--deadline-s", "--worker-timeout-s", "--max-in-flight",
                     "--scheduler-timeout-s", "--jetstream-replicas")
    scheduler.add_argument("--scheduler-id", help="default: the NATS user (--nats-user), else scheduler-<random>")
    scheduler.set_defaults(func=lazy("kvpush.services.cli.serve:cmd_scheduler"))


def add_gateway(sub) -> None:
    gateway = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway (/v1/completions, "
                                            "/v1/chat/completions, /v1/models, /health, /ready)")
    engine_options(gateway)
    cli_settings.add(gateway, "--log-level", "--api-key", "--api-keys-file", "--max-concurrent-per-key",
                     "--rate-per-key", "--burst-per-key")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8000)
    gateway.add_argument("--served-model-name", help="the model name clients send (default: the model folder's name)")
    gateway.add_argument("--tool-call-parser", choices=["auto", "hermes", "none"], default="auto",
                         help="the model's tool-call format, as vLLM's parser of that name reads it (auto: hermes if "
                              "the chat template writes <tool_call>, as the built models' does; none: tools refused)")
    gateway.set_defaults(func=lazy("kvpush.services.cli.serve:cmd_gateway"))


def add_worker(sub) -> None:
    worker = sub.add_parser("worker", help="run one prefill or decode worker")
    engine_options(worker)
    worker.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker.add_argument("--worker-id", help="default: the NATS user (--nats-user), else <role>-<random>; a restart "
                                            "keeps the id and gets a new incarnation")
    cli_settings.add(worker, "--connector", "--block-size", "--max-num-seqs", "--tensor-parallel-size", "--prefix-caching", "--push-by-layer", "--json-whitespace", "--log-level", "--metrics-port", "--metrics-host", "--lease-s", "--kv-wait-s", "--quarantine-s",
                     "--on-kv-failure")
    worker.set_defaults(func=lazy("kvpush.services.cli.serve:cmd_worker"))


def add_generate(sub) -> None:
    generate = sub.add_parser("generate", help="send one request to kvpush.generate and stream the reply")
    generate.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    nats_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, help="nucleus sampling (vLLM's top_p)")
    generate.add_argument("--top-k", type=int, help="sample from the k most likely tokens (vLLM's top_k)")
    generate.add_argument("--seed", type=int, help="a repeatable sample: the same seed gives the same tokens")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--token-ids", action="store_true", help="the prompt is a list of token ids")
    generate.set_defaults(func=lazy("kvpush.services.cli.requests:cmd_generate"))


def add_cancel(sub) -> None:
    cancel = sub.add_parser("cancel", help="cancel a request by its request id, wherever it is")
    cancel.add_argument("request_id")
    nats_options(cancel)
    cancel.set_defaults(func=lazy("kvpush.services.cli.requests:cmd_cancel"))


def add_status(sub) -> None:
    status = sub.add_parser("status", help="ask the scheduler which workers it routes to; exit 1 if too few")
    nats_options(status)
    status.add_argument("--min-prefill", type=int, default=0)
    status.add_argument("--min-decode", type=int, default=0)
    status.add_argument("--timeout", type=float, default=2.0)
    status.add_argument("--http", metavar="URL", help="instead, ask a gateway or service: exit 0 if URL answers 200 "
                                                      "(e.g. http://127.0.0.1:8000/health)")
    status.set_defaults(func=lazy("kvpush.services.cli.requests:cmd_status"))


def add_nats_config(sub) -> None:
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
                                  "./certs; `python -m kvpush.tools.dev_certs DIR` makes development ones)")
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
    nats_config.set_defaults(func=lazy("kvpush.services.cli.tools:cmd_nats_config"))


def add_trace(sub) -> None:
    trace = sub.add_parser("trace", help="show where a request's time went, from the local span files")
    trace.add_argument("request_id", nargs="?")
    trace.add_argument("--summary", action="store_true", help="TTFT split across all recorded requests")
    trace.add_argument("--dir", help="span folder (default: $KVPUSH_TRACE_DIR or ~/.cache/kvpush/traces)")
    trace.set_defaults(func=lazy("kvpush.services.cli.tools:cmd_trace"))


def add_explain(sub) -> None:
    explain = sub.add_parser("explain", help="how one request was served: its path report (from its kept final, "
                                             "asked as the client that sent it) and its critical path (span files)")
    explain.add_argument("request_id")
    nats_options(explain)
    explain.add_argument("--dir", help="span folder (default: $KVPUSH_TRACE_DIR or ~/.cache/kvpush/traces)")
    explain.set_defaults(func=lazy("kvpush.services.cli.requests:cmd_explain"))


# name -> register(subparsers); main.LISTED orders them with the installed ones
COMMANDS: dict[str, Register] = {
    "model": add_model, "up": add_up, "demo": add_demo, "scheduler": add_scheduler, "gateway": add_gateway,
    "worker": add_worker, "generate": add_generate, "cancel": add_cancel, "status": add_status,
    "nats-config": add_nats_config, "trace": add_trace, "explain": add_explain,
}
