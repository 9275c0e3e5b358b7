"""kvpush: disaggregated LLM serving over NATS; the prompt's KV cache is pushed from prefill
into blocks decode registered in advance.

One installed package. Its parts are the repository's top-level folders:

    kvpush.client      the public Python API: send a request, stream its tokens, cancel it
    kvpush.shared      the contracts: wire types and subjects, errors, permissions, settings
    kvpush.otel        tracing and metrics plumbing
    kvpush.connector   the vLLM KV connector (one background thread owns every NIXL call)
    kvpush.services    scheduler, workers, gateway, the ``kvpush`` command, the launcher
    kvpush.tools       benchmark, fault rig and soak, hosts rig: above everything else

A part imports only its own layer or those listed above it (``python -m kvpush.tools.layers``
counts cycles and upward imports).
"""
