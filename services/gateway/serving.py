"""Serving one generation (``/v1/completions``, ``/v1/chat/completions``): the request's
id, its body (read within NATS's max_payload), the request parsed (``requests``), its
prompt measured and templated (``prompts``), then the first kvpush reply, and after it
either one whole JSON answer (``_whole``) or server-sent events (``_events``), built by
``responses``. A refusal before the first token is an OpenAI error object with its HTTP
status; one after a stream began is an error event before ``[DONE]``.

Each request is one kvpush request through the project's client (``kvpush.client``): the
same subjects, inboxes, cancel on early stop, and a final fetched again if it was lost. A
client that disconnects mid-stream cancels its request. The request's root span (an
incoming W3C ``traceparent`` joins its trace) ends with its answer, a stream's with its
last event, and carries the request's path report.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import propagate, trace

from kvpush.otel.attributes import path_attributes
from kvpush.services.gateway import responses, tool_calls
from kvpush.services.gateway.body import BodyTooLarge, read_body
from kvpush.services.gateway.errors import RateLimited
from kvpush.services.gateway.keys import Tenant
from kvpush.services.gateway.prompts import Prompt
from kvpush.services.gateway.requests import Kind, parse
from kvpush.shared import wire
from kvpush.shared.errors import BadJson, DeadlineExceeded, InvalidField, KvpushError

_tracer = trace.get_tracer("kvpush.gateway")

REQUEST_ID_HEADER = "X-Request-Id"


def error_response(code: str, message: str, request_id: str) -> JSONResponse:
    status, body = responses.error(code, message)
    return JSONResponse(body, status, headers={REQUEST_ID_HEADER: request_id})


def error_response_of(exc: KvpushError, request_id: str) -> JSONResponse:
    """``exc`` as an OpenAI error object, with its own HTTP status; 429 says when to retry,
    a 413 that left the body unread closes the connection."""
    status, body = responses.error(exc.code, exc.message, status=exc.http_status)
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


async def serve(gateway, http: Request, kind: Kind):
    """The response to one generation for the tenant the guard found (``http.state``);
    ``gateway``: the running ``Gateway`` (``service``), its connections, prompts and replies."""
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


async def _respond(gateway, http: Request, kind: Kind, tenant: Tenant, nc, request_id: str, span):
    """The answer to one /v1 request, under its root span ``span``."""
    try:
        request_id = _request_id(http)
        kvpush_id = _kvpush_id(tenant, request_id)
        data = await read_body(http, nc.max_payload)
        try:
            body = json.loads(data)
        except (ValueError, RecursionError):
            return error_response(BadJson.code, "the body is not valid JSON", request_id)
        request = parse(kind, body, gateway.served_model_name, gateway.tool_call_parser)
        gateway.prompts.check_size(request)
        await gateway.prompts.apply_chat_template(request)
        prompt = await gateway.prompts.prompt_seen(request)
    except KvpushError as exc:
        return error_response_of(exc, request_id)
    generate_body = {**request.generate, "request_id": kvpush_id}
    headers: dict[str, str] = {}
    propagate.inject(headers)
    replies = gateway.replies(tenant, generate_body, headers).__aiter__()
    try:
        first = await replies.__anext__()
    except (KvpushError, TimeoutError) as exc:
        await replies.aclose()
        if isinstance(exc, TimeoutError):
            return error_response(DeadlineExceeded.code, str(exc), request_id)
        return error_response(exc.code, exc.message, request_id)
    match first:
        case wire.ErrorReply(error=error):
            await replies.aclose()
            return error_response(error.code, error.message, request_id)
    if request.stream:
        return StreamingResponse(_events(request, request_id, first, replies, prompt, span),
                                 media_type="text/event-stream",
                                 headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"})
    return await _whole(request, request_id, first, replies, prompt)


def _with_prompt(request, prompt: Prompt | None, prompt_positions: list | None, text: str,
                 token_ids: list[int], positions: list | None, text_offset: int = 0) -> tuple[str, dict | None]:
    """A choice's first text and ``logprobs``: with ``echo``, the prompt before its tokens
    (the prompt's positions scored by prefill's prompt logprobs, its first by nobody), as
    vLLM's completion server echoes."""
    if not request.echo or prompt is None:
        return text, responses.logprobs_object(request, token_ids, positions, text_offset)
    prompt_positions = prompt_positions or [None] * len(prompt.token_ids)
    return prompt.text + text, responses.logprobs_object(
        request, [*prompt.token_ids, *token_ids], [*prompt_positions, *(positions or [])], text_offset,
        unscored={0: prompt.first_token})


async def _whole(request, request_id: str, first: wire.Reply, replies,
                 prompt: Prompt | None = None) -> JSONResponse:
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
        return error_response(code, str(exc), request_id)
    match reply:
        case wire.ErrorReply(error=error):
            return error_response(error.code, error.message, request_id)
        case wire.FinalReply():
            answers = []
            for i in range(request.n):
                shown, logprobs = _with_prompt(request, prompt, prompt_positions, "".join(text[i]), token_ids[i],
                                               positions[i])
                answers.append(responses.Answer(shown, token_ids[i], logprobs))
            _trace_path(trace.get_current_span(), reply)
            return JSONResponse(responses.response(request, request_id, answers, reply,
                                                    responses.prompt_logprobs_object(prompt_positions),
                                                    prompt.token_ids if prompt is not None else None),
                                headers={REQUEST_ID_HEADER: request_id, **responses.path_header(reply)})


def _trace_path(span, final: wire.FinalReply) -> None:
    """The request's path report on the gateway's span, the root of the request's trace."""
    if final.path is not None:
        span.set_attributes(path_attributes(final.path))


def _sse(event: dict | str) -> bytes:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()


async def _events(request, request_id: str, first: wire.Reply, replies,
                  prompt: Prompt | None = None, span=None) -> AsyncIterator[bytes]:
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
                logprobs = responses.logprobs_object(request, reply.token_ids, reply.logprobs, text_offset[index])
            if calls is not None:
                text = calls[index].feed(text)  # content only until a call starts
            yield _sse(responses.chunk(request, request_id, text, first=first_event, token_ids=reply.token_ids,
                                        logprobs=logprobs, index=index,
                                        prompt_token_ids=prompt.token_ids if first_event and prompt else None))
            text_offset[index] += len(text)
            sent_first.add(index)
            reply = await replies.__anext__()
        match reply:
            case wire.ErrorReply(error=error):
                yield _sse(responses.error(error.code, error.message)[1])
            case wire.FinalReply():
                _trace_path(span, reply)
                path = responses.path_object(reply)  # on the last event before [DONE]
                finishes = responses.finish_reasons(reply)
                for index, finish in enumerate(finishes):
                    if calls is not None and index < len(calls):
                        rest, deltas, finish = calls[index].finish(finish)
                        if rest or deltas:
                            yield _sse(responses.chunk(request, request_id, rest, first=index not in sent_first,
                                                        index=index, tool_calls=deltas))
                            sent_first.add(index)
                    event = responses.chunk(request, request_id, "", finish, first=index not in sent_first,
                                             index=index)
                    if path is not None and index == len(finishes) - 1 and not request.include_usage:
                        event["kvpush"] = path
                    yield _sse(event)
                if request.include_usage:
                    event = responses.usage_chunk(request, request_id, reply)
                    if path is not None:
                        event["kvpush"] = path
                    yield _sse(event)
        yield _sse("[DONE]")
    except (KvpushError, TimeoutError) as exc:
        yield _sse(responses.error(getattr(exc, "code", DeadlineExceeded.code), str(exc))[1])
        yield _sse("[DONE]")
    finally:
        await replies.aclose()  # early: the request is cancelled
        span.end()
