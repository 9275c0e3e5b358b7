"""The ``kvpush`` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

# Environment variables kvpush reads, each the default of an option or a setting.
ENVIRONMENT = {
    "KVPUSH_NATS_URL": "NATS server URL (--nats-url)",
    "KVPUSH_MODEL": "local Hugging Face model folder (--model)",
    "KVPUSH_MAX_MODEL_LEN": "context length the engines serve (--max-model-len)",
    "KVPUSH_LOG_LEVEL": "log level of the services (--log-level)",
    "KVPUSH_MODE": "how KV moves unless a request says: push or pull (scheduler --mode)",
    "KVPUSH_CONNECTOR": "the workers' KV connector: kvpush, vllm-nixl or vllm-nixl-push (--connector)",
    "KVPUSH_CACHE_DIR": "where built models and local traces go (default ~/.cache/kvpush)",
    "KVPUSH_TRACE_DIR": "where local OTLP-JSON span files go (default <cache>/traces)",
    "KVPUSH_DEADLINE_S": "every request gets a final message within this many seconds (scheduler --deadline-s)",
    "KVPUSH_WORKER_TIMEOUT_S": "a worker silent this long is lost: its requests are retried (--worker-timeout-s)",
    "KVPUSH_LEASE_S": "prefill keeps an unclaimed prompt's blocks this long without a renewal (--lease-s)",
    "KVPUSH_KV_WAIT_S": "decode gives registered blocks up after this long without the KV (--kv-wait-s)",
    "KVPUSH_QUARANTINE_S": "...and keeps them this long more unless prefill answers (--quarantine-s)",
    "KVPUSH_ON_KV_FAILURE": "recompute (the default) or fail, when pushed KV will not come (--on-kv-failure)",
    "KVPUSH_NATS_USER / _PASSWORD / _TOKEN / _NKEY_SEED / _CREDS": "NATS login (--nats-user ...); see deploy/README.md",
    "KVPUSH_NATS_TLS_CA / _TLS_CERT / _TLS_KEY": "NATS TLS: the CA to trust, the client certificate and key",
}
OTEL_ENVIRONMENT = {
    "OTEL_EXPORTER_OTLP_ENDPOINT": "send spans and metrics there (OTLP/HTTP) instead of local files",
    "OTEL_METRICS_EXPORTER": "'none' turns metric export off (e.g. for a traces-only backend)",
    "OTEL_METRIC_EXPORT_INTERVAL": "metric export interval in ms",
    "OTEL_SERVICE_NAME": "overrides the service name of one process",
}

DEFAULT_NATS_URL = os.environ.get("KVPUSH_NATS_URL", "nats://127.0.0.1:4222")

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Config:",
    "for line in open(path):",
]


def _say(message: str) -> None:
    print(f"[kvpush] {message}", file=sys.stderr, flush=True)


def _model_path(args) -> str:
    if args.model:
        return args.model
    from tools.model_build import build_model, default_model_dir

    folder = default_model_dir("small")
    _say(f"using the built-in small model in {folder} (building it if needed)")
    return str(build_model(folder))


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)


# ------------------------------------------------------------------ commands

def cmd_model_build(args) -> int:
    from tools.model_build import build_model, default_model_dir

    out = Path(args.out) if args.out else default_model_dir(args.profile)
    started = time.monotonic()
    path = build_model(out, profile=args.profile, seed=args.seed, force=args.force)
    _say(f"model '{args.profile}' ready in {path} ({time.monotonic() - started:.1f} s)")
    print(path)
    return 0


def _run_service(service_name: str, log_level: str, make_service) -> int:
    """Run one long-lived service (an async context manager) until SIGINT/SIGTERM."""
    from otel import setup as otel_setup
    from services import logs

    logs.configure(log_level)
    otel_setup.configure(service_name)

    async def serve() -> None:
        async with make_service():
            await _until_signalled()

    try:
        asyncio.run(serve())
    finally:
        otel_setup.shutdown()
    return 0


def cmd_scheduler(args) -> int:
    from services.scheduler.service import Scheduler
    from services.scheduler.validation import load_validator

    validator = load_validator(_model_path(args), args.max_model_len)
    return _run_service("kvpush-scheduler", args.log_level, lambda: Scheduler(
        args.nats_url, validator, mode=args.mode, deadline_s=args.deadline_s,
        worker_timeout_s=args.worker_timeout_s))


def cmd_worker(args) -> int:
    from services.worker.engine import FaultSettings
    from services.worker.service import Worker

    faults = FaultSettings(lease_s=args.lease_s, kv_wait_s=args.kv_wait_s, quarantine_s=args.quarantine_s,
                           on_kv_failure=args.on_kv_failure)
    return _run_service(f"kvpush-{args.role}", args.log_level, lambda: Worker(
        args.role, args.nats_url, _model_path(args), args.worker_id, args.max_model_len, connector=args.connector,
        faults=faults))


def cmd_cancel(args) -> int:
    from services.cli.client import cancel

    async def send() -> None:
        nc = await _connect(args.nats_url)
        try:
            await cancel(nc, args.request_id)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(send())
    _say(f"cancel sent for {args.request_id}")
    return 0


async def _connect(nats_url: str, **kwargs):
    import nats

    from shared.nats_security import connect_options

    return await nats.connect(nats_url, **kwargs, **connect_options())


def _start_stack(args, quiet: bool = False):
    from services.launch.stack import Stack

    env = {"KVPUSH_LOG_LEVEL": os.environ.get("KVPUSH_LOG_LEVEL", "WARNING")} if quiet else {}
    stack = Stack(
        _model_path(args),
        nats_url=args.nats_url,
        prefill=args.prefill,
        decode=args.decode,
        max_model_len=args.max_model_len,
        mode=args.mode,
        connector=args.connector,
        extra_env=env,
    )
    _say(f"starting NATS, a scheduler, {args.prefill} prefill and {args.decode} decode workers "
         "(vLLM engines take 30-60 s each on a CPU)")
    stack.start()
    return stack


def cmd_up(args) -> int:
    stack = _start_stack(args)

    async def run() -> None:
        await stack.wait_ready(timeout=args.ready_timeout, progress=_say)
        print(f"ready {stack.nats_url}", flush=True)
        _say(f"try: kvpush generate --nats-url {stack.nats_url} 'def main():'   (Ctrl-C stops everything)")
        await _until_signalled()

    try:
        asyncio.run(run())
    finally:
        _say("stopping")
        stack.stop()
    return 0


async def _stream(nats_url: str, body: dict, out=sys.stdout) -> dict:
    from services.cli.client import generate

    nc = await _connect(nats_url)
    try:
        final: dict = {}
        async for reply in generate(nc, body):
            if reply.get("finished"):
                final = reply
            else:
                out.write(reply["text"])
                out.flush()
        out.write("\n")
        return final
    finally:
        await nc.close()


def _describe_final(final: dict) -> str:
    if "error" in final:
        return f"error {final['error']['code']}: {final['error']['message']}"
    t = final.get("timings", {})
    return (f"finish_reason={final.get('finish_reason')} tokens={final.get('usage', {}).get('completion_tokens')} "
            f"ttft={t.get('ttft_ms', 0):.0f} ms tpot={t.get('tpot_ms', 0):.1f} ms")


def cmd_generate(args) -> int:
    import uuid

    from shared.errors import KvpushError

    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    if args.token_ids:
        body["prompt_token_ids"] = [int(t) for t in args.prompt.replace(",", " ").split()]
    else:
        body["prompt"] = args.prompt
    body["request_id"] = f"cli-{uuid.uuid4().hex[:12]}"  # so that Ctrl-C can cancel it
    try:
        final = asyncio.run(_stream(args.nats_url, body))
    except KvpushError as exc:
        final = {"error": {"code": exc.code, "message": exc.message}}
    except KeyboardInterrupt:
        _say(f"interrupted: request {body['request_id']} cancelled")
        return 130
    _say(_describe_final(final))
    return 1 if "error" in final else 0


def cmd_bench(args) -> int:
    from tqdm import tqdm

    from tools.bench.run import CONNECTORS, Bench, BenchConfig
    from tools.model_build import build_model, default_model_dir

    connectors = args.connectors.split(",")
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown:
        print(f"unknown connectors {unknown}; choose from {', '.join(CONNECTORS)}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    config = BenchConfig(
        model=model,
        profile=args.profile if not args.model else "custom",
        connectors=connectors,
        input_lens=[int(x) for x in args.input_lens.split(",")],
        rates=[float(x) for x in args.rates.split(",")] if args.rates else None,
        load_fractions=[float(x) for x in args.load.split(",")],
        requests=args.requests,
        warmup=args.warmup,
        output_len=args.output_len,
        seed=args.seed,
        out=Path(args.out),
    )
    groups = len(config.input_lens) * len(connectors) * (len(config.rates) if config.rates else len(config.load_fractions))
    with tqdm(total=groups * config.requests, unit="req", desc="bench", file=sys.stderr) as progress:
        bench = Bench(config, progress)
        asyncio.run(bench.run())
    bench.write()
    print((Path(args.out) / "table.md").read_text())
    _say(f"results in {args.out}: results.json, requests.csv, points.csv, table.md, plots/")
    for error in bench.errors:
        _say(f"not measured: {error}")
    return 0 if not bench.errors and not any(p.failures for p in bench.points) else 1


def cmd_soak(args) -> int:
    from tools.reliability.soak import markdown, run_soak

    report = asyncio.run(run_soak(
        _model_path(args), args.minutes, args.rate, Path(args.out), args.fault_every_s, args.seed,
        progress=_say))
    print(markdown(report))
    _say(f"results in {args.out}/soak.json")
    clean = not (report["requests_lost"] or report["wrong_outputs"] or report["unexpected_errors"]
                 or any(report["leaked_blocks"].values()) or report["processes_died_unexpectedly"])
    return 0 if clean else 1


def cmd_bench_transfer(args) -> int:
    from tools.bench import transfer as bench_transfer

    rows = bench_transfer.run(progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = bench_transfer.markdown(rows)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_status(args) -> int:
    from shared import wire

    async def ask() -> dict:
        nc = await _connect(args.nats_url, connect_timeout=args.timeout, max_reconnect_attempts=0)
        try:
            return json.loads((await nc.request(wire.SCHEDULER_STATUS_SUBJECT, b"", timeout=args.timeout)).data)
        finally:
            await nc.close()

    try:
        status = asyncio.run(ask())
    except Exception as exc:
        print(f"no scheduler answered on {args.nats_url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    print(json.dumps(status))
    enough = len(status["prefill_workers"]) >= args.min_prefill and len(status["decode_workers"]) >= args.min_decode
    return 0 if enough else 1


def cmd_trace(args) -> int:
    from pathlib import Path

    from tools import trace_view as view
    from otel.files import default_trace_dir, read_spans

    folder = Path(args.dir) if args.dir else default_trace_dir()
    spans = read_spans(folder)
    if args.summary:
        print(view.summary(spans))
        return 0
    if not args.request_id:
        print("give a request id, or --summary", file=sys.stderr)
        return 2
    trace = view.find_trace(spans, args.request_id)
    if trace is None:
        print(f"no trace for request {args.request_id!r} in {folder} (spans go there when "
              "OTEL_EXPORTER_OTLP_ENDPOINT is not set)", file=sys.stderr)
        return 1
    print(view.waterfall(trace))
    return 0


def cmd_demo(args) -> int:
    stack = _start_stack(args, quiet=True)

    async def run() -> int:
        await stack.wait_ready(timeout=args.ready_timeout, progress=_say)
        _say(f"ready {stack.nats_url}")
        failures = 0
        for i, prompt in enumerate(DEMO_PROMPTS):
            print(f"\n>>> {prompt!r}", flush=True)
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "request_id": f"demo-{run_id}-{i}"}
            final = await _stream(stack.nats_url, body)
            _say(_describe_final(final))
            failures += "error" in final
        return failures

    run_id = f"{int(time.time())}"
    try:
        failures = asyncio.run(run())
    finally:
        _say("stopping")
        stack.stop()
    if not failures and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        request_id = f"demo-{run_id}-{len(DEMO_PROMPTS) - 1}"
        _say(f"where the last request's time went (kvpush trace {request_id}):\n")
        cmd_trace(argparse.Namespace(dir=None, summary=False, request_id=request_id))
    return 1 if failures else 0


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
    build.set_defaults(func=cmd_model_build)

    def nats_options(p, nats_default):
        p.add_argument("--nats-url", default=nats_default)
        nats_security.add_arguments(p)

    def engine_options(p, nats_default):
        nats_options(p, nats_default)
        p.add_argument("--model", default=os.environ.get("KVPUSH_MODEL"),
                       help="a local Hugging Face model folder (default: the built-in small model)")
        p.add_argument("--max-model-len", type=int, default=int(os.environ.get("KVPUSH_MAX_MODEL_LEN", "2048")))

    def mode_option(p):
        p.add_argument("--mode", choices=["push", "pull"], default=os.environ.get("KVPUSH_MODE", "push"),
                       help="how the prompt's KV moves, unless a request says otherwise (transfer_mode)")

    def connector_option(p):
        p.add_argument("--connector", choices=["kvpush", "vllm-nixl", "vllm-nixl-push"],
                       default=os.environ.get("KVPUSH_CONNECTOR", "kvpush"),
                       help="KV connector of the engines: ours, or vLLM's NixlConnector (pull) or "
                            "NixlPushConnector, for side-by-side comparison")

    def stack_options(p):
        engine_options(p, None)
        mode_option(p)
        connector_option(p)
        p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
        p.add_argument("--decode", type=int, default=1, help="number of decode workers")
        p.add_argument("--ready-timeout", type=float, default=600.0)

    up = sub.add_parser("up", help="start NATS (unless --nats-url), a scheduler and workers; Ctrl-C stops")
    stack_options(up)
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser("demo", help="start the stack, stream a few requests through NATS, stop")
    stack_options(demo)
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(func=cmd_demo)

    scheduler = sub.add_parser("scheduler", help="run one scheduler")
    engine_options(scheduler, DEFAULT_NATS_URL)
    mode_option(scheduler)
    scheduler.add_argument("--log-level", default=os.environ.get("KVPUSH_LOG_LEVEL", "INFO"))
    scheduler.add_argument("--deadline-s", type=float, default=float(os.environ.get("KVPUSH_DEADLINE_S", "300")),
                           help="every accepted request gets a final message (an answer or an error) within this")
    scheduler.add_argument("--worker-timeout-s", type=float,
                           default=float(os.environ.get("KVPUSH_WORKER_TIMEOUT_S", "3")),
                           help="a worker without a heartbeat for this long is lost; its requests are retried")
    scheduler.set_defaults(func=cmd_scheduler)

    worker = sub.add_parser("worker", help="run one prefill or decode worker")
    engine_options(worker, DEFAULT_NATS_URL)
    worker.add_argument("--role", required=True, choices=["prefill", "decode"])
    worker.add_argument("--worker-id", help="default: <role>-<random>; a restart gets a new identity")
    connector_option(worker)
    worker.add_argument("--log-level", default=os.environ.get("KVPUSH_LOG_LEVEL", "INFO"))
    worker.add_argument("--lease-s", type=float, default=float(os.environ.get("KVPUSH_LEASE_S", "10")),
                        help="prefill: keep a finished prompt's blocks this long unless decode renews the lease")
    worker.add_argument("--kv-wait-s", type=float, default=float(os.environ.get("KVPUSH_KV_WAIT_S", "120")),
                        help="decode: give registered blocks up after this long without the KV")
    worker.add_argument("--quarantine-s", type=float, default=float(os.environ.get("KVPUSH_QUARANTINE_S", "10")),
                        help="decode: after giving blocks up, keep them this long unless prefill answers")
    worker.add_argument("--on-kv-failure", choices=["recompute", "fail"],
                        default=os.environ.get("KVPUSH_ON_KV_FAILURE", "recompute"),
                        help="decode: when the pushed KV will not come, compute the prompt here or fail")
    worker.set_defaults(func=cmd_worker)

    generate = sub.add_parser("generate", help="send one request to kvpush.generate and stream the reply")
    generate.add_argument("prompt", help="the prompt text (or token ids with --token-ids)")
    nats_options(generate, DEFAULT_NATS_URL)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--token-ids", action="store_true", help="the prompt is a list of token ids")
    generate.set_defaults(func=cmd_generate)

    cancel = sub.add_parser("cancel", help="cancel a request by its request id, wherever it is")
    cancel.add_argument("request_id")
    nats_options(cancel, DEFAULT_NATS_URL)
    cancel.set_defaults(func=cmd_cancel)
    bench = sub.add_parser("bench", help="kvpush push/pull and vLLM's connectors side by side, open-loop load")
    bench.add_argument("--connectors", default="kvpush-push,kvpush-pull,vllm-nixl,vllm-nixl-push")
    bench.add_argument("--input-lens", default="1024,4096", help="prompt lengths in tokens")
    bench.add_argument("--rates", help="arrival rates in req/s (default: --load fractions of measured capacity)")
    bench.add_argument("--load", default="0.3,0.6,0.85", help="fractions of one prefill worker's capacity")
    bench.add_argument("--requests", type=int, default=30, help="measured requests per point")
    bench.add_argument("--warmup", type=int, default=2)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--profile", default="small", choices=["small", "kv-heavy"])
    bench.add_argument("--model", help="a local model folder instead of a built-in profile")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(func=cmd_bench)

    soak = sub.add_parser("soak", help="requests under every kind of fault for a while; then what was lost, "
                                       "wrong or leaked (nothing, or exit 1)")
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson arrivals)")
    soak.add_argument("--fault-every-s", type=float, default=20.0, help="one fault, of each kind in turn, this often")
    soak.add_argument("--model", help="a local model folder (default: the built-in small model)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", default="soak-results")
    soak.set_defaults(func=cmd_soak)

    bench_transfer = sub.add_parser("bench-transfer", help="our transfer thread vs a raw NIXL WRITE, 1-256 MiB")
    bench_transfer.add_argument("--out", help="write the rows as JSON here")
    bench_transfer.set_defaults(func=cmd_bench_transfer)

    status = sub.add_parser("status", help="ask the scheduler which workers it routes to; exit 1 if too few")
    nats_options(status, DEFAULT_NATS_URL)
    status.add_argument("--min-prefill", type=int, default=0)
    status.add_argument("--min-decode", type=int, default=0)
    status.add_argument("--timeout", type=float, default=2.0)
    status.set_defaults(func=cmd_status)

    trace = sub.add_parser("trace", help="show where a request's time went, from the local span files")
    trace.add_argument("request_id", nargs="?")
    trace.add_argument("--summary", action="store_true", help="TTFT split across all recorded requests")
    trace.add_argument("--dir", help="span folder (default: $KVPUSH_TRACE_DIR or ~/.cache/kvpush/traces)")
    trace.set_defaults(func=cmd_trace)
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
