"""``kvpush conformance``: every row of the OpenAI table (``table``) against a single ``vllm
serve`` of the same model, in push, pull and local. It starts what it is not given the URL
of: a kvpush stack (its own NATS, one prefill, one decode, the gateway) and the single
``vllm serve``, both with the same engine arguments. Exit status 1 when an answer differs
(or kvpush serves what vLLM refuses); fields kvpush refuses are listed, and fail the run
only with ``--strict``."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from kvpush.services.cli.commands import lazy
from kvpush.shared import settings


def register_conformance(sub) -> None:
    parser = sub.add_parser("conformance", help="kvpush's OpenAI answers against a single vllm serve, field by field")
    parser.add_argument("--model", help="a local model folder (default: the built-in small model)")
    parser.add_argument("--max-model-len", type=int, default=settings.MAX_MODEL_LEN)
    parser.add_argument("--kvpush-url", help="a running kvpush gateway (default: start a stack)")
    parser.add_argument("--vllm-url", help="a running single vllm serve of the same model, started with the "
                                           "engine arguments kvpush's engines have (default: start one)")
    parser.add_argument("--modes", default="push,pull,local")
    parser.add_argument("--json-whitespace", default="none", choices=("any", "none"),
                        help="for what this starts: JSON answers without free whitespace (a random-weight "
                             "model otherwise spins in it)")
    parser.add_argument("--out", help="a folder for results.json and table.md")
    parser.add_argument("--strict", action="store_true", help="fail on fields kvpush refuses too")
    parser.set_defaults(func=lazy("kvpush.tools.conformance.cli:cmd_conformance"))


def cmd_conformance(args) -> int:
    from kvpush.services.cli.common import model_path, say
    from kvpush.services.launch.stack import Stack
    from kvpush.tools.conformance.run import as_json, run, table
    from kvpush.tools.conformance.single import SingleVllm

    model = model_path(args) if not (args.kvpush_url and args.vllm_url) else args.model
    logs = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvpush-conformance-"))
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as started:
        vllm_url, kvpush_url = args.vllm_url, args.kvpush_url
        single = stack = None
        if vllm_url is None:
            single = started.enter_context(SingleVllm(model, args.max_model_len, logs / "vllm-serve.log",
                                                      args.json_whitespace))
            vllm_url = single.url
        if kvpush_url is None:
            stack = Stack(model, max_model_len=args.max_model_len, log_dir=logs, gateway_port=0,
                          extra_env={"KVPUSH_JSON_WHITESPACE": args.json_whitespace, "KVPUSH_LOG_LEVEL": "WARNING"})
            stack.start()
            started.callback(stack.stop)
            kvpush_url = stack.gateway_url
        say("waiting for the systems to be ready")
        if single is not None:
            single.wait_ready()
        if stack is not None:
            asyncio.run(stack.wait_ready(timeout=400))
        results = asyncio.run(run(vllm_url, kvpush_url, modes=tuple(args.modes.split(","))))
    report = table(results)
    sys.stdout.write(report)
    if args.out:
        (logs / "results.json").write_text(json.dumps(as_json(results), indent=1))
        (logs / "table.md").write_text(report)
    failing = {"differs", "vllm refuses", "kvpush fails"} | ({"kvpush refuses"} if args.strict else set())
    bad = [r for r in results if r.outcome in failing]
    refused = sorted({r.field for r in results if r.outcome == "kvpush refuses"})
    say(f"{len(results)} answers compared: {sum(r.outcome == 'equal' for r in results)} equal, {len(bad)} failing"
        + (f"; kvpush refuses: {', '.join(refused)}" if refused else ""))
    return 1 if bad else 0
