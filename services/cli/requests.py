"""Commands that talk to a running stack: generate, cancel, status."""

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
                path = final.path
                line += (f"\npath: {path.mode} ({path.chosen_by}: {path.reason}) prefill={path.prefill_worker or '-'} "
                         f"decode={path.decode_worker} attempt={path.attempt}; prompt {path.prompt_tokens} tokens: "
                         f"received {path.received_tokens}, decode's cache {path.decode_cached_tokens}, "
                         f"computed on decode {path.decode_computed_tokens} (recomputed {path.recomputed_tokens})")
            return line


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
