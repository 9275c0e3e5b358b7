"""Commands that run a tool: build the model, benchmarks, the soak, the trace view."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from services.cli.common import model_path, say

def cmd_nats_config(args) -> int:
    import dataclasses
    import os

    from shared import permissions

    if args.sample:
        sys.stdout.write(permissions.sample_config())
        return 0
    roles = {"scheduler": args.schedulers, "prefill": args.prefill, "decode": args.decode, "client": args.clients}
    try:
        identities = [
            permissions.Identity(role, name.strip(), permissions.new_password() if args.passwords == "random" else "")
            for role, names in roles.items() for name in names.split(",") if name.strip()
        ]
        password = permissions.literal_password if args.passwords == "random" else permissions.env_password
        tls = None
        if not args.no_tls:
            folder = Path(args.tls_dir).resolve()
            tls = {"cert_file": str(folder / "server.pem"), "key_file": str(folder / "server-key.pem"),
                   "ca_file": str(folder / "ca.pem")}
        given = {name: getattr(args, f"js_{name}") for name in ("max_memory", "max_file", "max_streams", "max_consumers")
                 if getattr(args, f"js_{name}") is not None}
        limits = dataclasses.replace(permissions.JetStreamLimits.for_identities(identities), **given)
        config = permissions.render_config(identities, password, tls=tls, port=args.port, listen=args.listen,
                                           limits=limits)
    except ValueError as exc:
        print(f"kvpush nats-config: {exc}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(config)
        os.chmod(args.out, 0o600)
        say(f"wrote {args.out}: {len(identities)} users")
    else:
        sys.stdout.write(config)
    if args.passwords == "random" and args.passwords_out:
        fd = os.open(args.passwords_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.writelines(f"{identity.name}={identity.password}\n" for identity in identities)
        say(f"wrote the passwords to {args.passwords_out}")
    elif args.passwords == "env":
        say("the server reads each password from its environment: "
            + ", ".join(permissions.password_variable(identity.name) for identity in identities))
    if tls is not None and not all(Path(path).is_file() for path in tls.values()):
        say(f"note: {Path(tls['cert_file']).parent} does not hold server.pem, server-key.pem and ca.pem (yet); "
            "nats-server needs them to start (`python -m tools.dev_certs DIR` makes development ones)")
    return 0


def cmd_model_build(args) -> int:
    from tools.model_build import build_model, default_model_dir

    out = Path(args.out) if args.out else default_model_dir(args.profile)
    started = time.monotonic()
    path = build_model(out, profile=args.profile, seed=args.seed, force=args.force)
    say(f"model '{args.profile}' ready in {path} ({time.monotonic() - started:.1f} s)")
    print(path)
    return 0


def cmd_bench(args) -> int:
    from tools.bench.run import BINDING_PROBE, GRID, VARIANTS, Bench, BenchConfig, Workload
    from tools.bench.systems import BINDINGS, Topology
    from tools.model_build import build_model, default_model_dir

    variants = args.systems.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown systems {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    bindings = {}
    for pair in filter(None, (args.binding or "").split(",")):
        system, _, binding = pair.partition("=")
        if binding not in BINDINGS:
            print(f"--binding {pair!r}: give system=binding, binding one of {', '.join(BINDINGS)}", file=sys.stderr)
            return 2
        bindings[system] = binding
    if args.input_lens:
        topology = Topology(args.prefill, args.decode)
        shape = "".join([f" mixed ±{args.range_ratio:g}" if args.range_ratio else "",
                         f" burstiness {args.burstiness:g}" if args.burstiness != 1.0 else "",
                         f" with {args.background} long generations" if args.background else ""])
        workloads = [Workload(f"{n} tokens{shape}" if topology == Topology() else f"{n} tokens {topology.label}{shape}",
                              n, tuple(float(r) for r in args.rates.split(",")), args.requests, topology,
                              range_ratio=args.range_ratio, burstiness=args.burstiness, background=args.background,
                              background_output_len=args.background_output_len)
                     for n in (int(x) for x in args.input_lens.split(","))]
    else:
        workloads = list(GRID)
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    probe = BINDING_PROBE if args.probe_requests is None else \
        Workload(BINDING_PROBE.name, BINDING_PROBE.input_len, BINDING_PROBE.rates, args.probe_requests)
    config = BenchConfig(model=model, profile=args.profile if not args.model else "custom", variants=variants,
                         workloads=workloads, output_len=args.output_len, seed=args.seed, warmups=args.warmup,
                         out=Path(args.out), bindings=bindings, probe=probe, raw_bandwidth=not args.no_raw_nixl,
                         try_bindings=tuple(args.try_bindings.split(",")))
    bench = Bench(config, say=lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    asyncio.run(bench.run())
    bench.write()
    print((Path(args.out) / "tables.md").read_text())
    failed = [p for p in bench.points if p.error or p.summary.get("failed")]
    return 1 if bench.errors or failed else 0


def cmd_soak(args) -> int:
    from tools.reliability.soak import markdown, run_soak

    report = asyncio.run(run_soak(
        model_path(args), args.minutes, args.rate, Path(args.out), args.fault_every_s, args.seed,
        progress=say))
    print(markdown(report))
    say(f"results in {args.out}/soak.json")
    clean = not (report["requests_lost"] or report["wrong_outputs"] or report["unexpected_errors"]
                 or any(report["leaked_blocks"].values()) or report["processes_died_unexpectedly"])
    return 0 if clean else 1


def cmd_bench_multiturn(args) -> int:
    from tools.bench import multiturn, multiturn_run
    from tools.bench.systems import Topology
    from tools.model_build import build_model, default_model_dir

    systems = tuple(args.systems.split(","))
    known = {"kvpush-push", "kvpush-pull", "kvpush-auto", "kvpush-local", "vllm-nixl", "vllm-nixl-push"}
    if unknown := [s for s in systems if s not in known]:
        print(f"unknown systems {unknown}; choose from {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    load = multiturn.Conversations(count=args.conversations, turns=args.turns, first_len=args.first_len,
                                   turn_len=args.turn_len, output_len=args.output_len,
                                   concurrency=args.concurrency, seed=args.seed)
    results = multiturn_run.bench(model, Path(args.out), load, args.max_model_len,
                                  Topology(args.prefill, args.decode), systems,
                                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(multiturn_run.markdown(results))
    wrong = sum(len(run["wrong_outputs"]) + run["failed"] for run in results["runs"].values())
    return 1 if wrong else 0


def cmd_bench_transfer(args) -> int:
    from tools.bench import transfer as bench_transfer

    rows = bench_transfer.run(progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = bench_transfer.markdown(rows)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def cmd_trace(args) -> int:
    from pathlib import Path

    from tools import trace_view as view
    from otel.files import default_trace_dir, read_spans

    folder = Path(args.dir) if args.dir else default_trace_dir()
    spans = read_spans(folder)
    if args.summary:
        print(view.summary(spans))
        return 0
    if not args.request_id:
        print("give a request id, or --summary", file=sys.stderr)
        return 2
    trace = view.find_trace(spans, args.request_id)
    if trace is None:
        print(f"no trace for request {args.request_id!r} in {folder} (spans go there when "
              "OTEL_EXPORTER_OTLP_ENDPOINT is not set)", file=sys.stderr)
        return 1
    print(view.waterfall(trace))
    return 0
