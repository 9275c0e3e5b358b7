"""Commands that talk to a running stack: generate, cancel, status."""

from __future__ import annotations

import asyncio
import sys

from services.cli.common import connect, say

async def stream(nats_url: str, body: dict, out=sys.stdout) -> dict:
    from services.cli.client import generate

    nc = await connect(nats_url)
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


def describe_final(final: dict) -> str:
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
        final = asyncio.run(stream(args.nats_url, body))
    except KvpushError as exc:
        final = {"error": {"code": exc.code, "message": exc.message}}
    except KeyboardInterrupt:
        say(f"interrupted: request {body['request_id']} cancelled")
        return 130
    say(describe_final(final))
    return 1 if "error" in final else 0


def cmd_cancel(args) -> int:
    from services.cli.client import cancel

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
    from services.cli.client import scheduler_status

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

    from shared import wire

    try:
        status = asyncio.run(ask())
    except Exception as exc:
        print(f"no scheduler answered on {args.nats_url}: {type(exc).__name__}", file=sys.stderr)
        return 1
    print(wire.encode_json(status).decode())
    enough = len(status.prefill_workers) >= args.min_prefill and len(status.decode_workers) >= args.min_decode
    return 0 if enough else 1
