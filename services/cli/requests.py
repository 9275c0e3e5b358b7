"""Commands that talk to a running stack: generate, cancel, status, explain."""

from __future__ import annotations

import asyncio
import sys

from kvpush.services.cli.common import connect, say
from kvpush.shared import wire


async def stream(nats_url: str, body: dict, out=sys.stdout) -> wire.LastMessage:
    from kvpush.client import generate

    nc = await connect(nats_url)
    try:
        async for reply in generate(nc, body):
            match reply:
                case wire.TokenChunk():
                    out.write(reply.text)
                    out.flush()
                case _:
                    final = reply
        out.write("\n")
        return final
    finally:
        await nc.close()


def describe_final(final: wire.LastMessage) -> str:
    match final:
        case wire.ErrorReply(error=error):
            return f"error {error.code}: {error.message}"
        case wire.FinalReply(finish_reason=finish_reason, usage=usage, timings=t):
            line = (f"finish_reason={finish_reason} tokens={usage.completion_tokens} "
                    f"ttft={t.ttft_ms:.0f} ms tpot={t.tpot_ms:.1f} ms")
            if final.path is not None:
                line += "\n" + describe_path(final.path)
            return line


def describe_path(path: wire.PathReport) -> str:
    """A path report (``wire.PathReport``) in a few lines."""
    def count(value) -> str:
        return "unknown" if value is None else str(value)

    lines = [
        f"path: {path.mode}, chosen by {path.chosen_by} ({path.reason or 'no reason given'})",
        f"  workers: prefill {path.prefill_worker or '-'}, decode {path.decode_worker}; attempt {path.attempt} "
        f"({path.retries} retries), {path.moves} moves, {path.takeovers} takeovers; kv_policy {path.kv_policy}",
        f"  prompt {path.prompt_tokens} tokens: computed on prefill {count(path.prefill_computed_tokens)}, "
        f"received {count(path.received_tokens)} ({count(path.received_blocks)} blocks, "
        f"{count(path.received_bytes)} bytes), found in decode's cache {count(path.decode_cached_tokens)}, "
        f"computed on decode {path.decode_computed_tokens} (recomputed {path.recomputed_tokens})",
    ]
    if len(path.received_by_rank) > 1:  # tensor parallelism: each decode rank received its own heads
        lines.append("  received by rank: " + "; ".join(
            f"rank {part.rank} {part.blocks} blocks, {part.bytes} bytes" for part in path.received_by_rank))
    if path.prefix_source:
        lines.append(f"  cached prefix: {path.prefix_source}" + (
            f", {path.fetched_tokens} tokens read from {path.fetched_from}'s cache" if path.fetched_tokens else ""))
    if path.kv_checksum is not None:
        lines.append(f"  KV checksum: {path.kv_checksum}")
    if path.kv_failure:
        lines.append(f"  the KV did not arrive intact: {path.kv_failure}"
                     + (f" ({path.kv_failure_reason})" if path.kv_failure_reason else ""))
    if path.migrations:
        lines.append(f"  migrated mid-stream {path.migrations} times, after "
                     f"{', '.join(str(k) for k in path.resumed_after)} tokens; the last resumed by "
                     f"{path.continuation} (this decode's prompt: the last attempt's)")
    return "\n".join(lines)


async def explain(nc, request_id: str, spans: list[dict]) -> tuple[str, bool]:
    """What ``kvpush explain`` prints for one request (asking as ``nc``'s client, whose
    request ids these are): its kept final's path report, and its trace's critical path
    from ``spans``. (text, whether the final was found)."""
    from kvpush.client import ask_final
    from kvpush.otel import trace_view

    last = await ask_final(nc, request_id)
    lines = [f"request {request_id}"]
    found = False
    match last:
        case wire.FinalReply():
            found = True
            lines.append(describe_final(last))
            if last.path is None:
                lines.append("path: not reported (its decode predates path reports)")
        case wire.ErrorReply(error=error) if error.code in ("in_flight", "not_found"):
            lines.append(f"no final kept: {error.message}")
        case wire.ErrorReply():
            found = True
            lines.append(describe_final(last))
        case None:
            lines.append("no scheduler answered")
    trace = trace_view.find_trace(spans, request_id)
    lines.append("")
    lines.extend(trace_view.critical_path_lines(trace) if trace else
                 ["trace: none in the span files (spans go there when OTEL_EXPORTER_OTLP_ENDPOINT is not set; "
                  "with a collector, find the trace there by kvpush.request_id)"])
    return "\n".join(lines), found


def cmd_explain(args) -> int:
    from pathlib import Path

    from kvpush.otel.files import default_trace_dir, read_spans

    spans = read_spans(Path(args.dir) if args.dir else default_trace_dir())

    async def ask() -> tuple[str, bool]:
        nc = await connect(args.nats_url)
        try:
            return await explain(nc, args.request_id, spans)
        finally:
            await nc.close()

    text, found = asyncio.run(ask())
    print(text)
    return 0 if found else 1


def cmd_generate(args) -> int:
    import uuid

    from kvpush.shared.errors import KvpushError, to_error_body

    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature, "ignore_eos": args.ignore_eos}
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name, None) is not None:
            body[name] = getattr(args, name)
    if args.token_ids:
        body["prompt_token_ids"] = [int(t) for t in args.prompt.replace(",", " ").split()]
    else:
        body["prompt"] = args.prompt
    body["request_id"] = f"cli-{uuid.uuid4().hex[:12]}"  # so that Ctrl-C can cancel it
    try:
        final = asyncio.run(stream(args.nats_url, body))
    except KvpushError as exc:
        final = wire.ErrorReply(body["request_id"], to_error_body(exc))
    except KeyboardInterrupt:
        say(f"interrupted: request {body['request_id']} cancelled")
        return 130
    say(describe_final(final))
    return 1 if isinstance(final, wire.ErrorReply) else 0


def cmd_cancel(args) -> int:
    from kvpush.client import cancel

    async def send() -> None:
        nc = await connect(args.nats_url)
        try:
            await cancel(nc, args.request_id)
            await nc.flush()
        finally:
            await nc.close()

    asyncio.run(send())
    say(f"cancel sent for {args.request_id}")
    return 0


def cmd_status(args) -> int:
    from kvpush.client import scheduler_status

    if args.http:
        import urllib.request

        try:
            with urllib.request.urlopen(args.http, timeout=args.timeout) as reply:
                print(reply.read().decode())
                return 0 if reply.status == 200 else 1
        except OSError as exc:
            print(f"{args.http} did not answer 200: {exc}", file=sys.stderr)
            return 1

    async def ask() -> wire.SchedulerStatus:
        nc = await connect(args.nats_url, connect_timeout=args.timeout, max_reconnect_attempts=0)
        try:
            return await scheduler_status(nc, args.timeout)
        finally:
            await nc.close()

    try:
        status = asyncio.run(ask())
    except Exception as exc:
        print(f"no scheduler answered on {args.nats_url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    print(wire.encode_json(status).decode())
    enough = len(status.prefill_workers) >= args.min_prefill and len(status.decode_workers) >= args.min_decode
    return 0 if enough else 1
