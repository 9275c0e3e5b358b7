"""Commands that serve: one scheduler, one worker, or the whole stack (``up``, ``demo``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from kvpush.otel import setup as otel_setup
from kvpush.services import logs
from kvpush.services.cli.common import model_path, say, until_signalled, until_signalled_or_failed
from kvpush.services.cli.requests import describe_final, stream
from kvpush.services.cli.tools import cmd_trace
from kvpush.services.gateway.keys import KeyRing
from kvpush.services.gateway.limits import Limits
from kvpush.services.gateway.service import Gateway
from kvpush.services.launch.stack import Stack
from kvpush.services.scheduler.service import Scheduler
from kvpush.services.scheduler.validation import load_validator
from kvpush.services.worker.engine import on_cpu
from kvpush.services.worker.engine_settings import block_size_problem, layer_wise
from kvpush.services.worker.service import Worker, worker_id_for
from kvpush.shared import wire
from kvpush.shared.nats_security import nats_user
from kvpush.shared.settings import FaultSettings

DEMO_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Config:",
    "for line in open(path):",
]


def _run_service(service_name: str, log_level: str, make_service, metrics_port: int | None = None,
                 prometheus: bool = False, metrics_host: str | None = None) -> int:
    """Run one long-lived service (an async context manager) until SIGINT/SIGTERM.
    ``metrics_port``: its /metrics and /health (a worker's engine core, started by it,
    takes the next port)."""
    logs.configure(log_level)
    if metrics_port is not None:  # in the environment: the engine core it starts reads it too
        os.environ[otel_setup.METRICS_PORT_ENV] = str(metrics_port)
    if metrics_host is not None:
        os.environ["KVPUSH_METRICS_HOST"] = metrics_host
    otel_setup.configure(service_name, prometheus=prometheus)

    async def serve() -> int:
        async with make_service() as service:
            failed = await until_signalled_or_failed(service)
        if failed:
            say(f"{service_name} stopped: {failed}")
            return 1
        return 0

    try:
        return asyncio.run(serve())
    finally:
        otel_setup.shutdown()


def cmd_scheduler(args) -> int:
    validator = load_validator(model_path(args), args.max_model_len)
    return _run_service("kvpush-scheduler", args.log_level, lambda: Scheduler(
        args.nats_url, validator, scheduler_id=args.scheduler_id, mode=args.mode, deadline_s=args.deadline_s,
        worker_timeout_s=args.worker_timeout_s, max_in_flight=args.max_in_flight,
        scheduler_timeout_s=args.scheduler_timeout_s, ledger_replicas=args.jetstream_replicas,
        local_below_tokens=args.local_below_tokens, push_within_s=args.push_within_s, kv_policy=args.kv_policy,
        kv_checksums=args.kv_checksums, max_migrations=args.max_migrations, stall_s=args.stall_s,
        prefix_fetch=args.prefix_fetch, fetch_link_gbps=args.fetch_link_gbps),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host)


def cmd_gateway(args) -> int:
    try:
        limits = Limits(args.max_concurrent_per_key, args.rate_per_key, args.burst_per_key)
        if args.api_key and args.api_keys_file:
            raise ValueError("give --api-key (one key) or --api-keys-file (one tenant per key), not both")
        if args.api_keys_file:
            keys = KeyRing.from_file(args.api_keys_file, limits, gateway_user=nats_user())
        else:
            keys = KeyRing.single(args.api_key, limits) if args.api_key else KeyRing.open(limits)
    except ValueError as exc:
        say(f"refusing to start: {exc}")
        return 2
    return _run_service("kvpush-gateway", args.log_level, lambda: Gateway(
        args.nats_url, model_path(args), host=args.host, port=args.port, served_model_name=args.served_model_name,
        keys=keys, max_model_len=args.max_model_len, tool_call_parser=args.tool_call_parser),
        prometheus=True)  # its /metrics is on its own HTTP port


def cmd_worker(args) -> int:
    try:
        faults = FaultSettings(lease_s=args.lease_s, kv_wait_s=args.kv_wait_s, quarantine_s=args.quarantine_s,
                               on_kv_failure=args.on_kv_failure)
        worker_id = worker_id_for(args.role, args.worker_id, nats_user())
        if problem := block_size_problem(args.block_size or None, on_cpu()):
            raise ValueError(problem)
    except ValueError as exc:
        say(f"refusing to start: {exc}")
        return 2
    return _run_service(f"kvpush-{args.role}", args.log_level, lambda: Worker(
        args.role, args.nats_url, model_path(args), worker_id, args.max_model_len, connector=args.connector,
        faults=faults, prefix_caching=args.prefix_caching == "on", push_by_layer=layer_wise(args.push_by_layer),
        json_whitespace=args.json_whitespace, tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size or None, max_num_seqs=args.max_num_seqs),
        metrics_port=args.metrics_port, metrics_host=args.metrics_host)


def _start_stack(args, quiet: bool = False):
    env = {"KVPUSH_LOG_LEVEL": os.environ.get("KVPUSH_LOG_LEVEL", "WARNING")} if quiet else {}
    stack = Stack(
        model_path(args),
        nats_url=args.nats_url,
        prefill=args.prefill,
        decode=args.decode,
        max_model_len=args.max_model_len,
        mode=args.mode,
        connector=args.connector,
        prefix_caching=args.prefix_caching,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        block_size=args.block_size or None,
        max_num_seqs=args.max_num_seqs,
        extra_env=env,
        gateway_port=None if args.gateway_port < 0 else args.gateway_port,
    )
    say(f"starting NATS, a scheduler, {args.prefill} prefill and {args.decode} decode workers "
         "(vLLM engines take 30-60 s each on a CPU)")
    stack.start()
    return stack


def cmd_up(args) -> int:
    stack = _start_stack(args)

    async def run() -> None:
        await stack.wait_ready(timeout=args.ready_timeout, progress=say)
        print(f"ready {stack.nats_url}" + (f" {stack.gateway_url}" if stack.gateway_url else ""), flush=True)
        say(f"try: kvpush generate --nats-url {stack.nats_url} 'def main():'   (Ctrl-C stops everything)")
        if stack.gateway_url:
            say(f"or:  curl {stack.gateway_url}/v1/completions -H 'Content-Type: application/json' "
                "-d '{\"prompt\": \"def main():\", \"max_tokens\": 32, \"temperature\": 0}'")
        await until_signalled()

    try:
        asyncio.run(run())
    finally:
        say("stopping")
        stack.stop()
    return 0


def cmd_demo(args) -> int:
    stack = _start_stack(args, quiet=True)

    async def run() -> int:
        await stack.wait_ready(timeout=args.ready_timeout, progress=say)
        say(f"ready {stack.nats_url}")
        failures = 0
        for i, prompt in enumerate(DEMO_PROMPTS):
            print(f"\n>>> {prompt!r}", flush=True)
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "request_id": f"demo-{run_id}-{i}"}
            final = await stream(stack.nats_url, body)
            say(describe_final(final))
            failures += isinstance(final, wire.ErrorReply)
        return failures

    run_id = f"{int(time.time())}"
    try:
        failures = asyncio.run(run())
    finally:
        say("stopping")
        stack.stop()
    if not failures and not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        request_id = f"demo-{run_id}-{len(DEMO_PROMPTS) - 1}"
        say(f"where the last request's time went (kvpush trace {request_id}):\n")
        cmd_trace(argparse.Namespace(dir=None, summary=False, request_id=request_id))
    return 1 if failures else 0
