"""Commands that run a tool: build the model, benchmarks, the soak, the trace view."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from services.cli.common import model_path, say

def cmd_nats_config(args) -> int:
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
        if args.tls_dir:
            folder = Path(args.tls_dir).resolve()
            tls = {"cert_file": str(folder / "server.pem"), "key_file": str(folder / "server-key.pem"),
                   "ca_file": str(folder / "ca.pem")}
        config = permissions.render_config(identities, password, tls=tls, port=args.port)
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
    from tqdm import tqdm

    from tools.bench.run import CONNECTORS, Bench, BenchConfig
    from tools.model_build import build_model, default_model_dir

    connectors = args.connectors.split(",")
    unknown = [c for c in connectors if c not in CONNECTORS]
    if unknown:
        print(f"unknown connectors {unknown}; choose from {', '.join(CONNECTORS)}", file=sys.stderr)
        return 2
    model = args.model or str(build_model(default_model_dir(args.profile), profile=args.profile))
    config = BenchConfig(
        model=model,
        profile=args.profile if not args.model else "custom",
        connectors=connectors,
        input_lens=[int(x) for x in args.input_lens.split(",")],
        rates=[float(x) for x in args.rates.split(",")] if args.rates else None,
        load_fractions=[float(x) for x in args.load.split(",")],
        requests=args.requests,
        warmup=args.warmup,
        output_len=args.output_len,
        seed=args.seed,
        out=Path(args.out),
    )
    groups = len(config.input_lens) * len(connectors) * (len(config.rates) if config.rates else len(config.load_fractions))
    with tqdm(total=groups * config.requests, unit="req", desc="bench", file=sys.stderr) as progress:
        bench = Bench(config, progress)
        asyncio.run(bench.run())
    bench.write()
    print((Path(args.out) / "table.md").read_text())
    say(f"results in {args.out}: results.json, requests.csv, points.csv, table.md, plots/")
    for error in bench.errors:
        say(f"not measured: {error}")
    return 0 if not bench.errors and not any(p.failures for p in bench.points) else 1


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
