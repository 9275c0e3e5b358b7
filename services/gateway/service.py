"""The gateway: OpenAI's HTTP API in front of ``kvpush.generate``.

``async with Gateway(nats_url, model):`` serves ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (the process is up) and
``GET /ready`` (a scheduler routes to at least one prefill and one decode worker) until
closed. Each HTTP request becomes one kvpush request through the project's client
(``services.cli.client``): the same subjects, inboxes, cancel on early stop, and a final
fetched again if it was lost. A client that disconnects mid-stream cancels its request.

FastAPI on uvicorn, as vLLM's own server. The chat template is the model's tokenizer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator

import nats
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace

from otel import endpoint
from otel.metrics import instruments
from services.cli.client import generate, scheduler_status
from services.gateway import openai_api
from services.lifecycle import Service
from shared import settings, wire
from shared.errors import InvalidField, KvpushError, NoScheduler, PayloadTooLarge, RequestError
from shared.nats_security import connect_options, server_urls

log = structlog.get_logger("kvpush.gateway")
_tracer = trace.get_tracer("kvpush.gateway")

DEFAULT_PORT = 8000
REQUEST_ID_HEADER = "X-Request-Id"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway(Service):
    def __init__(self, nats_url: str, model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 served_model_name: str | None = None, timeout_s: float = settings.DEADLINE_S + 30):
        self.nats_url = nats_url
        self.model = model
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or model.rstrip("/").rsplit("/", 1)[-1]
        self.timeout_s = timeout_s
        self.nc = None
        self.tokenizer = None
        self._server: _Server | None = None
        self._serving: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = await asyncio.get_running_loop().run_in_executor(
            None, AutoTokenizer.from_pretrained, self.model)
        self.nc = await nats.connect(server_urls(self.nats_url), name="kvpush-gateway", max_reconnect_attempts=-1,
                                     **connect_options())
        config = uvicorn.Config(build_app(self), host=self.host, port=self.port, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = _Server(config)
        self._serving = asyncio.get_running_loop().create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # the bind failed: raise it
                raise RuntimeError(f"the gateway could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        if self.port == 0:
            self.port = self._server.servers[0].sockets[0].getsockname()[1]
        # A metrics port of its own (KVPUSH_METRICS_PORT) says it serves HTTP; whether kvpush
        # routes to workers is the gateway's own /ready.
        endpoint.mark_ready()
        log.info("gateway ready", url=self.url, model=self.served_model_name)

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    # ------------------------------------------------------------------ requests

    def prompt_of(self, request: openai_api.OpenAiRequest) -> None:
        """Chat: the messages through the model's chat template, as token ids."""
        if request.messages is None:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField(f"the model '{self.served_model_name}' has no chat template; use /v1/completions")
        request.generate["prompt_token_ids"] = chat_prompt(self.tokenizer, request.messages)

    def replies(self, body: dict, headers: dict[str, str]) -> AsyncIterator[dict]:
        return generate(self.nc, body, timeout=self.timeout_s, headers=headers)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation's token ids, as vLLM's chat endpoint makes them: the model's chat
    template with the generation prompt."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def build_app(gateway: Gateway) -> FastAPI:
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
        return {"object": "list", "data": [{
            "id": gateway.served_model_name, "object": "model", "created": 0, "owned_by": "kvpush",
            "root": gateway.model, "max_model_len": getattr(gateway.tokenizer, "model_max_length", None),
        }]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return _counted("/v1/completions", await _serve(gateway, request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return _counted("/v1/chat/completions", await _serve(gateway, request, "chat"))

    return app


def _counted(endpoint: str, response):
    instruments().http_requests.add(1, {"endpoint": endpoint, "status": str(response.status_code)})
    return response


def _error(code: str, message: str, request_id: str) -> JSONResponse:
    status, body = openai_api.error(code, message)
    return JSONResponse(body, status, headers={REQUEST_ID_HEADER: request_id})


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    problem = wire.request_id_problem(given)
    if problem is not None:
        raise InvalidField(f"the {REQUEST_ID_HEADER} header: {problem}")
    return given


async def _serve(gateway: Gateway, http: Request, kind: openai_api.Kind):
    request_id = http.headers.get(REQUEST_ID_HEADER) or ""
    parent = propagate.extract(dict(http.headers))  # an incoming W3C traceparent joins the trace
    with _tracer.start_as_current_span(f"gateway {kind}", context=parent, kind=trace.SpanKind.SERVER):
        try:
            request_id = _request_id(http)
            limit = gateway.nc.max_payload
            length = http.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise PayloadTooLarge(f"the body is {length} bytes, over the {limit}-byte limit")
            data = await http.body()
            if len(data) > limit:
                raise PayloadTooLarge(f"the body is {len(data)} bytes, over the {limit}-byte limit")
            try:
                body = json.loads(data)
            except (ValueError, RecursionError):
                return _error("bad_json", "the body is not valid JSON", request_id)
            request = openai_api.parse(kind, body, gateway.served_model_name)
            gateway.prompt_of(request)
        except KvpushError as exc:
            return _error(exc.code, exc.message, request_id)
        generate_body = {**request.generate, "request_id": request_id}
        headers: dict[str, str] = {}
        propagate.inject(headers)
        replies = gateway.replies(generate_body, headers).__aiter__()
        try:
            first = await replies.__anext__()
        except (KvpushError, TimeoutError) as exc:
            await replies.aclose()
            if isinstance(exc, TimeoutError):
                return _error("deadline_exceeded", str(exc), request_id)
            return _error(exc.code, exc.message, request_id)
        if first.get("finished") and "error" in first:
            await replies.aclose()
            return _error(first["error"]["code"], first["error"]["message"], request_id)
        if request.stream:
            return StreamingResponse(_events(request, request_id, first, replies), media_type="text/event-stream",
                                     headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"})
        return await _whole(request, request_id, first, replies)


async def _whole(request, request_id: str, first: dict, replies) -> JSONResponse:
    text: list[str] = []
    token_ids: list[int] = []
    reply = first
    try:
        while not reply.get("finished"):
            text.append(reply["text"])
            token_ids.extend(reply["token_ids"])
            reply = await replies.__anext__()
    except (KvpushError, TimeoutError, StopAsyncIteration) as exc:
        await replies.aclose()
        code = getattr(exc, "code", "deadline_exceeded")
        return _error(code, str(exc), request_id)
    if "error" in reply:
        return _error(reply["error"]["code"], reply["error"]["message"], request_id)
    return JSONResponse(openai_api.response(request, request_id, "".join(text), reply, token_ids),
                        headers={REQUEST_ID_HEADER: request_id})


def _sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()


async def _events(request, request_id: str, first: dict, replies) -> AsyncIterator[bytes]:
    """Server-sent events; a client that goes away cancels the request (the generator is
    closed, and the client's generate() cancels what did not finish)."""
    reply, sent_first = first, False
    try:
        while not reply.get("finished"):
            yield _sse(openai_api.chunk(request, request_id, reply["text"], first=not sent_first,
                                        token_ids=reply["token_ids"]))
            sent_first = True
            reply = await replies.__anext__()
        if "error" in reply:
            yield _sse(openai_api.error(reply["error"]["code"], reply["error"]["message"])[1])
        else:
            yield _sse(openai_api.chunk(request, request_id, "", reply.get("finish_reason"), first=not sent_first))
            if request.include_usage:
                yield _sse(openai_api.usage_chunk(request, request_id, reply))
        yield _sse("[DONE]")
    except (KvpushError, TimeoutError) as exc:
        yield _sse(openai_api.error(getattr(exc, "code", "deadline_exceeded"), str(exc))[1])
        yield _sse("[DONE]")
    finally:
        await replies.aclose()  # early: the request is cancelled
