"""The gateway: OpenAI's HTTP API in front of ``kvpush.generate``.

``async with Gateway(nats_url, model):`` serves ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (the process is up) and
``GET /ready`` (a scheduler routes to at least one prefill and one decode worker) until
closed. Each HTTP request becomes one kvpush request through the project's client
(``kvpush.client``): the same subjects, inboxes, cancel on early stop, and a final
fetched again if it was lost. A client that disconnects mid-stream cancels its request.

API keys (``kvpush.services.gateway.keys``): with keys, a ``/v1`` request without a valid
``Authorization: Bearer <key>`` gets 401; each key is a tenant with its own kvpush client
(its own NATS connection and user, when the keys file gives it one) and its own limits
(``kvpush.services.gateway.limits``): a generation past them gets 429. ``/health``, ``/ready``
and ``/metrics`` need no key.

Bounded work before the bounds: the body is read as it arrives and refused (413) the
moment it would pass the NATS server's max_payload, whatever its transfer encoding; a
prompt is measured in bytes before anything tokenizes it; the chat template runs on a
thread of its own, never on the event loop.

FastAPI on uvicorn, as vLLM's own server. The chat template is the model's tokenizer's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import json
import math
import os
import time
import uuid
from typing import AsyncIterator

import nats
import structlog
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from starlette.datastructures import Headers

from kvpush.otel import endpoint
from kvpush.otel.attributes import path_attributes
from kvpush.otel.metrics import instruments
from kvpush.client import generate, scheduler_status
from kvpush.services.gateway import openai_api, tool_calls
from kvpush.services.gateway.body import BodyTooLarge, read_body
from kvpush.services.gateway.errors import RateLimited
from kvpush.services.gateway.keys import KeyRing, Tenant
from kvpush.services.gateway.limits import Limiter
from kvpush.services.lifecycle import Service
from kvpush.shared import settings, wire
from kvpush.shared.errors import BadJson, DeadlineExceeded, InvalidField, KvpushError, PromptTooLong
from kvpush.shared.nats_security import ENV_VARS, connect_options, error_logger, server_urls

log = structlog.get_logger("kvpush.gateway")
_tracer = trace.get_tracer("kvpush.gateway")

DEFAULT_PORT = 8000
REQUEST_ID_HEADER = "X-Request-Id"
GUARDED_PREFIX = "/v1/"  # needs a key (as vLLM's --api-key guards /v1); /health, /ready, /metrics do not
GENERATIONS = ("/v1/completions", "/v1/chat/completions")  # count against a key's limits
_LOGIN_VARIABLES = {ENV_VARS[d] for d in ("nats_user", "nats_password", "nats_token", "nats_nkey_seed", "nats_creds")}


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Gateway(Service):
    """``keys``: who may call it, and as which kvpush client (default: anyone, as the
    gateway's own NATS identity, no limits). ``max_model_len``: the context the engines
    serve, which bounds a prompt's bytes before it is tokenized."""

    def __init__(self, nats_url: str, model: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 served_model_name: str | None = None, timeout_s: float = settings.DEADLINE_S + 30,
                 keys: KeyRing | None = None, max_model_len: int = settings.MAX_MODEL_LEN,
                 tool_call_parser: str = "auto"):
        self.nats_url = nats_url
        self.model = model
        self.host = host
        self.port = port
        self.served_model_name = served_model_name or model.rstrip("/").rsplit("/", 1)[-1]
        self.timeout_s = timeout_s
        self.keys = keys or KeyRing.open()
        self.max_model_len = max_model_len
        self.tool_call_parser_setting = tool_call_parser
        self.tool_call_parser: str | None = None  # set at start: the model's format, or None (tools refused)
        self.max_prompt_bytes = 0  # set at start, from the tokenizer
        self.nc = None  # the gateway's own NATS identity: /ready, and tenants without a NATS user
        self._tenant_connections: dict[str, nats.NATS] = {}  # tenant name -> its own NATS identity
        self._limiters = {tenant.name: Limiter(tenant.limits, time.monotonic()) for tenant in self.keys.tenants}
        # A Hugging Face tokenizer must not be used from two threads at once: one thread.
        self._templating = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")
        self.tokenizer = None
        self._server: _Server | None = None
        self._serving: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> None:
        from transformers import AutoTokenizer

        loop = asyncio.get_running_loop()
        self.tokenizer = await loop.run_in_executor(self._templating, AutoTokenizer.from_pretrained, self.model)
        self.tool_call_parser = tool_call_parser_of(self.tool_call_parser_setting,
                                                    getattr(self.tokenizer, "chat_template", None))
        self.max_prompt_bytes = await loop.run_in_executor(self._templating, prompt_byte_limit, self.tokenizer,
                                                           self.max_model_len)
        self.nc = await nats.connect(server_urls(self.nats_url), name="kvpush-gateway", max_reconnect_attempts=-1,
                                     error_cb=error_logger("kvpush-gateway"), **connect_options())
        for tenant in self.keys.tenants:
            if tenant.nats_user is not None:  # like the gateway's own: waits for NATS, and says why it cannot log in
                self._tenant_connections[tenant.name] = await nats.connect(
                    server_urls(self.nats_url), name=f"kvpush-gateway-{tenant.name}", max_reconnect_attempts=-1,
                    error_cb=_tenant_errors(tenant), **connect_options(tenant_login(tenant)))
        config = uvicorn.Config(_Guard(build_app(self), self), host=self.host, port=self.port, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = _Server(config)
        self._serving = loop.create_task(self._server.serve())
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
        log.info("gateway ready", url=self.url, model=self.served_model_name,
                 keys="required" if self.keys.required else "none", tenants=len(self.keys.tenants))

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._serving is not None:
            await asyncio.gather(self._serving, return_exceptions=True)
        for nc in [*self._tenant_connections.values(), self.nc]:
            if nc is not None and not nc.is_closed:
                await nc.drain()
        self._templating.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ requests

    def connection(self, tenant: Tenant):
        """The NATS connection that serves ``tenant``: its own, or the gateway's."""
        return self._tenant_connections.get(tenant.name, self.nc)

    def limiter(self, tenant: Tenant) -> Limiter:
        return self._limiters[tenant.name]

    def check_prompt_size(self, request: openai_api.OpenAiRequest) -> None:
        """Refuse, before anything tokenizes it, a prompt too long in bytes to fit the context."""
        size = openai_api.prompt_bytes(request)
        if size > self.max_prompt_bytes:
            raise PromptTooLong(f"the prompt is {size} bytes: more than {self.max_model_len} tokens of this model "
                                f"can hold (at most {self.max_prompt_bytes} bytes), so it cannot fit the context; "
                                "send a shorter prompt")

    async def prompt_of(self, request: openai_api.OpenAiRequest) -> None:
        """Chat: the messages through the model's chat template, as token ids (on the
        template thread: a long chat takes a while, and the event loop serves everyone)."""
        if request.messages is None:
            return
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField(f"the model '{self.served_model_name}' has no chat template; use /v1/completions")
        request.generate["prompt_token_ids"] = await asyncio.get_running_loop().run_in_executor(
            self._templating, chat_prompt, self.tokenizer, request.messages, request.tools)

    async def prompt_seen(self, request: openai_api.OpenAiRequest) -> openai_api.Prompt | None:
        """A completion's prompt as the client gets it back (``echo``, token ids), tokenized
        as the scheduler tokenizes it; None when the response shows no prompt."""
        if request.kind != "completion" or not (request.echo or request.return_token_ids):
            return None
        text = request.generate.get("prompt")

        def run() -> openai_api.Prompt:
            ids = list(self.tokenizer.encode(text)) if text is not None else list(request.generate["prompt_token_ids"])
            shown = "" if request.return_token_ids else (text if text is not None else self.tokenizer.decode(ids))
            return openai_api.Prompt(shown, ids, self.tokenizer.decode(ids[:1]))

        return await asyncio.get_running_loop().run_in_executor(self._templating, run)

    async def tokenize(self, request: openai_api.TokenizeRequest) -> list[int]:
        """``/tokenize``, as the engines tokenize: the model's own tokenizer (and chat template)."""
        if request.messages is not None and not getattr(self.tokenizer, "chat_template", None):
            raise InvalidField(f"the model '{self.served_model_name}' has no chat template")
        text_size = len(request.prompt.encode()) if request.prompt is not None else \
            sum(len(m["content"].encode()) for m in request.messages or [])
        if text_size > self.max_prompt_bytes:
            raise PromptTooLong(f"the text is {text_size} bytes: more than {self.max_model_len} tokens of this "
                                f"model can hold (at most {self.max_prompt_bytes} bytes)")

        def run() -> list[int]:
            if request.messages is not None:
                return list(self.tokenizer.apply_chat_template(
                    request.messages, add_generation_prompt=request.add_generation_prompt, tokenize=True,
                    return_dict=False))
            return list(self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))

        return await asyncio.get_running_loop().run_in_executor(self._templating, run)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.get_running_loop().run_in_executor(self._templating, self.tokenizer.decode, token_ids)

    def replies(self, tenant: Tenant, body: dict, headers: dict[str, str]) -> AsyncIterator[wire.Reply]:
        return generate(self.connection(tenant), body, timeout=self.timeout_s, headers=headers)


def _tenant_errors(tenant: Tenant):
    async def said(exc: Exception) -> None:
        log.warning("a tenant's NATS connection failed", tenant=tenant.name, nats_user=tenant.nats_user,
                    error=str(exc))
    return said


def tenant_login(tenant: Tenant, env=os.environ) -> dict[str, str]:
    """The environment ``connect_options`` reads for ``tenant``'s own connection: the
    gateway's (TLS and all) with the tenant's NATS user and password for its login."""
    return {**{k: v for k, v in env.items() if k not in _LOGIN_VARIABLES},
            ENV_VARS["nats_user"]: tenant.nats_user, ENV_VARS["nats_password"]: tenant.nats_password}


def prompt_byte_limit(tokenizer, max_model_len: int) -> int:
    """The most bytes a prompt of ``max_model_len`` tokens can hold. A token stands for at
    most as many bytes as its longest vocabulary entry's UTF-8 (a byte-level or
    sentencepiece entry is never shorter than the bytes it stands for); a tokenizer that
    normalizes text first (NFC, NFKC, lowercasing) may shrink it, by at most 3x."""
    longest = max((len(token.encode()) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrinks = backend is None or backend.normalizer is not None
    return max_model_len * longest * (4 if shrinks else 1)


def chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation's token ids, as vLLM's chat endpoint makes them: the model's chat
    template with the generation prompt (and the tools, which it shows the model)."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def tool_call_parser_of(setting: str, chat_template: str | None) -> str | None:
    """The tool-call format the gateway reads: the one named, none, or (``auto``) hermes
    when the model's chat template writes Hermes-style ``<tool_call>`` calls."""
    if setting == "none":
        return None
    if setting != "auto":
        return setting
    return "hermes" if chat_template and tool_calls.START in chat_template else None


class _Guard:
    """Pure ASGI, in front of the app: who a ``/v1`` request is (401 without a valid key),
    and for a generation a place within its key's limits (429 past them), held until the
    response has gone out, a stream's to its end, whichever way it ends."""

    def __init__(self, app, gateway: Gateway):
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
            response = _counted(endpoint, _error_of(exc, given if wire.request_id_problem(given) is None else ""))
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        try:
            await self.app(scope, receive, send)
        finally:
            if limited:
                limiter.release()


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
            ids = await gateway.tokenize(openai_api.tokenize_request(body, gateway.served_model_name))
        except KvpushError as exc:
            return _error_of(exc, "")
        return {"count": len(ids), "max_model_len": gateway.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await _json_object(request, gateway)
            ids = openai_api.detokenize_request(body, gateway.served_model_name, len(gateway.tokenizer))
            text = await gateway.detokenize(ids)
        except KvpushError as exc:
            return _error_of(exc, "")
        return {"prompt": text}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return _counted("/v1/completions", await _serve(gateway, request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return _counted("/v1/chat/completions", await _serve(gateway, request, "chat"))

    return app


async def _json_object(http: Request, gateway: Gateway):
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


def _error(code: str, message: str, request_id: str) -> JSONResponse:
    status, body = openai_api.error(code, message)
    return JSONResponse(body, status, headers={REQUEST_ID_HEADER: request_id})


def _error_of(exc: KvpushError, request_id: str) -> JSONResponse:
    """``exc`` as an OpenAI error object, with its own HTTP status; 429 says when to retry,
    a 413 that left the body unread closes the connection."""
    status, body = openai_api.error(exc.code, exc.message, status=exc.http_status)
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if isinstance(exc, RateLimited):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if isinstance(exc, BodyTooLarge) and exc.unread:
        headers["Connection"] = "close"
    return JSONResponse(body, status, headers=headers)


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    problem = wire.request_id_problem(given)
    if problem is not None:
        raise InvalidField(f"the {REQUEST_ID_HEADER} header: {problem}")
    return given


def _kvpush_id(tenant: Tenant, request_id: str) -> str:
    kvpush_id = tenant.kvpush_id(request_id)
    if wire.request_id_problem(kvpush_id) is not None:
        raise InvalidField(f"the {REQUEST_ID_HEADER} header: at most "
                           f"{wire.MAX_REQUEST_ID_LEN - len(tenant.id_prefix)} characters with this API key")
    return kvpush_id


async def _serve(gateway: Gateway, http: Request, kind: openai_api.Kind):
    tenant: Tenant = http.state.tenant
    nc = gateway.connection(tenant)
    request_id = http.headers.get(REQUEST_ID_HEADER) or ""
    parent = propagate.extract(dict(http.headers))  # an incoming W3C traceparent joins the trace
    # The request's root span: a stream's ends with its last event (``_events``), the others here.
    span = _tracer.start_span(f"gateway {kind}", context=parent, kind=trace.SpanKind.SERVER)
    streams = False
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            response = await _respond(gateway, http, kind, tenant, nc, request_id, span)
            streams = isinstance(response, StreamingResponse)
            return response
    finally:
        if not streams:
            span.end()


async def _respond(gateway: Gateway, http: Request, kind: openai_api.Kind, tenant: Tenant, nc, request_id: str,
                   span):
    """The answer to one /v1 request, under its root span ``span``."""
    try:
        request_id = _request_id(http)
        kvpush_id = _kvpush_id(tenant, request_id)
        data = await read_body(http, nc.max_payload)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return _error(BadJson.code, "the body is not valid JSON", request_id)
        request = openai_api.parse(kind, body, gateway.served_model_name, gateway.tool_call_parser)
        gateway.check_prompt_size(request)
        await gateway.prompt_of(request)
        prompt = await gateway.prompt_seen(request)
    except KvpushError as exc:
        return _error_of(exc, request_id)
    generate_body = {**request.generate, "request_id": kvpush_id}
    headers: dict[str, str] = {}
    propagate.inject(headers)
    replies = gateway.replies(tenant, generate_body, headers).__aiter__()
    try:
        first = await replies.__anext__()
    except (KvpushError, TimeoutError) as exc:
        await replies.aclose()
        if isinstance(exc, TimeoutError):
            return _error(DeadlineExceeded.code, str(exc), request_id)
        return _error(exc.code, exc.message, request_id)
    match first:
        case wire.ErrorReply(error=error):
            await replies.aclose()
            return _error(error.code, error.message, request_id)
    if request.stream:
        return StreamingResponse(_events(request, request_id, first, replies, prompt, span),
                                 media_type="text/event-stream",
                                 headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"})
    return await _whole(request, request_id, first, replies, prompt)


def _with_prompt(request, prompt: openai_api.Prompt | None, prompt_positions: list | None, text: str,
                 token_ids: list[int], positions: list | None, text_offset: int = 0) -> tuple[str, dict | None]:
    """A choice's first text and ``logprobs``: with ``echo``, the prompt before its tokens
    (the prompt's positions scored by prefill's prompt logprobs, its first by nobody), as
    vLLM's completion server echoes."""
    if not request.echo or prompt is None:
        return text, openai_api.logprobs_object(request, token_ids, positions, text_offset)
    prompt_positions = prompt_positions or [None] * len(prompt.token_ids)
    return prompt.text + text, openai_api.logprobs_object(
        request, [*prompt.token_ids, *token_ids], [*prompt_positions, *(positions or [])], text_offset,
        unscored={0: prompt.first_token})


async def _whole(request, request_id: str, first: wire.Reply, replies,
                 prompt: openai_api.Prompt | None = None) -> JSONResponse:
    # each answer's (by index): text pieces, token ids, logprobs per position
    text: list[list[str]] = [[] for _ in range(request.n)]
    token_ids: list[list[int]] = [[] for _ in range(request.n)]
    positions: list[list[list[wire.TokenLogprob]]] = [[] for _ in range(request.n)]
    prompt_positions = None  # the prompt's logprobs, on answer 0's first chunk
    reply = first
    try:
        while isinstance(reply, wire.TokenChunk):
            if 0 <= reply.index < request.n:
                text[reply.index].append(reply.text)
                token_ids[reply.index].extend(reply.token_ids)
                positions[reply.index].extend(reply.logprobs or [])
            if reply.prompt_logprobs is not None:
                prompt_positions = reply.prompt_logprobs
            reply = await replies.__anext__()
    except (KvpushError, TimeoutError, StopAsyncIteration) as exc:
        await replies.aclose()
        code = getattr(exc, "code", DeadlineExceeded.code)
        return _error(code, str(exc), request_id)
    match reply:
        case wire.ErrorReply(error=error):
            return _error(error.code, error.message, request_id)
        case wire.FinalReply():
            answers = []
            for i in range(request.n):
                shown, logprobs = _with_prompt(request, prompt, prompt_positions, "".join(text[i]), token_ids[i],
                                               positions[i])
                answers.append(openai_api.Answer(shown, token_ids[i], logprobs))
            _trace_path(trace.get_current_span(), reply)
            return JSONResponse(openai_api.response(request, request_id, answers, reply,
                                                    openai_api.prompt_logprobs_object(prompt_positions),
                                                    prompt.token_ids if prompt is not None else None),
                                headers={REQUEST_ID_HEADER: request_id, **openai_api.path_header(reply)})


def _trace_path(span, final: wire.FinalReply) -> None:
    """The request's path report on the gateway's span, the root of the request's trace."""
    if final.path is not None:
        span.set_attributes(path_attributes(final.path))


def _sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()


async def _events(request, request_id: str, first: wire.Reply, replies,
                  prompt: openai_api.Prompt | None = None, span=None) -> AsyncIterator[bytes]:
    """Server-sent events; a client that goes away cancels the request (the generator is
    closed, and the client's generate() cancels what did not finish). ``span``: the
    request's root span, ended with the last event."""
    span = span or trace.INVALID_SPAN
    reply = first
    sent_first: set[int] = set()  # the answers whose first event went (a chat's role comes in it)
    text_offset = [0] * request.n  # each answer's characters so far
    prompt_positions = None  # the prompt's logprobs (echo with logprobs), on answer 0's first chunk
    calls = [tool_calls.StreamedCalls(request.tool_calling) for _ in range(request.n)] \
        if request.tool_calling is not None else None  # each answer's text, read for calls
    try:
        while isinstance(reply, wire.TokenChunk):
            index = reply.index if 0 <= reply.index < request.n else 0
            if reply.prompt_logprobs is not None:
                prompt_positions = reply.prompt_logprobs
            first_event = index not in sent_first
            if first_event:  # an echo goes before the answer's first tokens
                text, logprobs = _with_prompt(request, prompt, prompt_positions, reply.text, reply.token_ids,
                                              reply.logprobs)
            else:
                text = reply.text
                logprobs = openai_api.logprobs_object(request, reply.token_ids, reply.logprobs, text_offset[index])
            if calls is not None:
                text = calls[index].feed(text)  # content only until a call starts
            yield _sse(openai_api.chunk(request, request_id, text, first=first_event, token_ids=reply.token_ids,
                                        logprobs=logprobs, index=index,
                                        prompt_token_ids=prompt.token_ids if first_event and prompt else None))
            text_offset[index] += len(text)
            sent_first.add(index)
            reply = await replies.__anext__()
        match reply:
            case wire.ErrorReply(error=error):
                yield _sse(openai_api.error(error.code, error.message)[1])
            case wire.FinalReply():
                _trace_path(span, reply)
                path = openai_api.path_object(reply)  # on the last event before [DONE]
                finishes = openai_api.finish_reasons(reply)
                for index, finish in enumerate(finishes):
                    if calls is not None and index < len(calls):
                        rest, deltas, finish = calls[index].finish(finish)
                        if rest or deltas:
                            yield _sse(openai_api.chunk(request, request_id, rest, first=index not in sent_first,
                                                        index=index, tool_calls=deltas))
                            sent_first.add(index)
                    event = openai_api.chunk(request, request_id, "", finish, first=index not in sent_first,
                                             index=index)
                    if path is not None and index == len(finishes) - 1 and not request.include_usage:
                        event["kvpush"] = path
                    yield _sse(event)
                if request.include_usage:
                    event = openai_api.usage_chunk(request, request_id, reply)
                    if path is not None:
                        event["kvpush"] = path
                    yield _sse(event)
        yield _sse("[DONE]")
    except (KvpushError, TimeoutError) as exc:
        yield _sse(openai_api.error(getattr(exc, "code", DeadlineExceeded.code), str(exc))[1])
        yield _sse("[DONE]")
    finally:
        await replies.aclose()  # early: the request is cancelled
        span.end()
