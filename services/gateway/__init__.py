"""The gateway: OpenAI's HTTP API in front of ``kvpush.generate``, one module per concern,
as vLLM's OpenAI server is laid out (``vllm/entrypoints/openai/``):

    service.py     ``Gateway``: start and stop (the tokenizer, a NATS connection per tenant,
                   the limiters, the uvicorn server); what each request is served with
    app.py         the FastAPI route table, behind ``Guard`` (API keys and limits)
    serving.py     one generation: the first kvpush reply, then a whole JSON answer or
                   server-sent events
    prompts.py     the tokenizer's work on a thread of its own: the chat template, prompt
                   byte limits, the echoed prompt, /tokenize and /detokenize
    requests.py    pure: an OpenAI body as kvpush GenerateRequest fields
    responses.py   pure: kvpush replies as OpenAI objects (choices, chunks, logprobs, usage,
                   the path report and header, errors)
    tool_calls.py  pure: OpenAI tools as ``ToolCalling``, and calls read out of an answer
    body.py        a request body read within a bound
    keys.py        API keys: who a request is, as which kvpush client
    limits.py      pure: per-key limits (in progress, rate)
    errors.py      the gateway's own refusals (401, 429)

Why a mapping of our own, not vLLM's OpenAI serving layer over an engine client that
speaks kvpush's protocol (issue 28): that layer (``OpenAIServingChat`` and its kin) is
built on vLLM's ``EngineClient``, its renderer, input processors and model config, whose
signatures have changed from one vLLM release to the next; following them would tie the
gateway to each release's internals and bring vLLM and torch into a process that today
needs only a tokenizer. What this mapping costs instead is keeping
up with the API's fields, and ``kvpush conformance`` (tools/conformance) measures exactly
that against a single ``vllm serve`` of the same release, field by field, in CI. Chat
templates are the tokenizer's own (``transformers``), as vLLM renders them. Tools are
the one place that follows vLLM's internals, and only on decode, which runs vLLM anyway:
the grammar of a required or named call is built there by vLLM's own structural-tag
builders (``kvpush.services.worker.tool_calling``); the gateway reads the calls with the
hermes parser's few rules, and conformance compares them with vLLM's own reading.
"""
