"""The gateway's HTTP app: the FastAPI route table, behind ``Guard``, the pure ASGI layer
that checks API keys and limits.

    GET  /health               the process is up
    GET  /ready                a scheduler routes to at least one prefill and one decode worker
    GET  /metrics              Prometheus
    GET  /version
    GET  /v1/models            as ``vllm serve``'s
    POST /tokenize, /detokenize               the model's tokenizer (``prompts``)
    POST /v1/completions, /v1/chat/completions   a generation (``serving``)

``/v1`` needs a key, when the gateway has keys (``keys``): without a valid ``Authorization:
Bearer <key>``, 401; a generation past its key's limits (``limits``), 429. ``/health``,
``/ready`` and ``/metrics`` need no key.
"""

from __future__ import annotations

import importlib.metadata
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from kvpush.client import scheduler_status
from kvpush.otel.metrics import instruments
from kvpush.services.gateway.body import read_body
from kvpush.services.gateway.requests import detokenize_request, tokenize_request
from kvpush.services.gateway.serving import REQUEST_ID_HEADER, error_response_of, serve
from kvpush.shared import wire
from kvpush.shared.errors import BadJson, KvpushError

GUARDED_PREFIX = "/v1/"  # needs a key (as vLLM's --api-key guards /v1); /health, /ready, /metrics do not
GENERATIONS = ("/v1/completions", "/v1/chat/completions")  # count against a key's limits


class Guard:
    """Pure ASGI, in front of the app: who a ``/v1`` request is (401 without a valid key),
    and for a generation a place within its key's limits (429 past them), held until the
    response has gone out, a stream's to its end, whichever way it ends."""

    def __init__(self, app, gateway):
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limited = scope["path"] in GENERATIONS and scope["method"] == "POST"
        try:
            tenant = self.gateway.keys.tenant(headers.get("authorization"))
            limiter = self.gateway.limiter(tenant)
            if limited:
                limiter.admit(time.monotonic())
        except KvpushError as exc:
            given = headers.get(REQUEST_ID_HEADER) or ""
            endpoint = scope["path"] if scope["path"] in (*GENERATIONS, "/v1/models") else "/v1/*"  # bounded labels
            shown_id = given if wire.request_id_problem(given) is None else ""
            response = _counted(endpoint, error_response_of(exc, shown_id))
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        try:
            await self.app(scope, receive, send)
        finally:
            if limited:
                limiter.release()


def build_app(gateway) -> FastAPI:
    """The routes of the running ``gateway`` (``service.Gateway``)."""
    app = FastAPI(title="kvpush", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        try:
            status = await scheduler_status(gateway.nc, timeout=2.0)
        except Exception as exc:
            return JSONResponse({"ready": False, "reason": f"no scheduler answers ({type(exc).__name__})"}, 503)
        ok = bool(status.prefill_workers and status.decode_workers)
        return JSONResponse({"ready": ok, "prefill_workers": len(status.prefill_workers),
                             "decode_workers": len(status.decode_workers)}, 200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        """As ``vllm serve``'s, with the context the engines serve (the least of the
        workers a scheduler routes to; the gateway's own setting if none answers)."""
        try:
            max_model_len = (await scheduler_status(gateway.nc, timeout=2.0)).max_model_len or gateway.max_model_len
        except Exception:
            max_model_len = gateway.max_model_len
        return {"object": "list", "data": [{
            "id": gateway.served_model_name, "object": "model", "created": 0, "owned_by": "kvpush",
            "root": gateway.model, "max_model_len": max_model_len,
        }]}

    @app.get("/version")
    async def version():
        return {"version": kvpush_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            body = await _json_object(request, gateway)
            ids = await gateway.prompts.tokenize(tokenize_request(body, gateway.served_model_name))
        except KvpushError as exc:
            return error_response_of(exc, "")
        return {"count": len(ids), "max_model_len": gateway.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await _json_object(request, gateway)
            ids = detokenize_request(body, gateway.served_model_name, len(gateway.prompts.tokenizer))
            text = await gateway.prompts.detokenize(ids)
        except KvpushError as exc:
            return error_response_of(exc, "")
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return _counted("/v1/completions", await serve(gateway, request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return _counted("/v1/chat/completions", await serve(gateway, request, "chat"))

    return app


async def _json_object(http: Request, gateway):
    """A small JSON body (bounded like a generation's by NATS's max_payload)."""
    data = await read_body(http, gateway.nc.max_payload)
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise BadJson("the body is not valid JSON") from None


def kvpush_version() -> str:
    try:
        return importlib.metadata.version("kvpush")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _counted(endpoint: str, response):
    instruments().http_requests.add(1, {"endpoint": endpoint, "status": str(response.status_code)})
    return response
