"""Commands on local files: a nats-server config, the built-in model, the local traces.

The benchmarks and the soak are tools (tools/): they add their own commands
(``kvpush.services.cli.commands``)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

from kvpush.otel import trace_view as view
from kvpush.otel.files import default_trace_dir, read_spans
from kvpush.services.cli.common import say
from kvpush.services.launch.model import build_model, default_model_dir
from kvpush.shared import permissions


def cmd_nats_config(args) -> int:
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
            "nats-server needs them to start (`python -m kvpush.tools.dev_certs DIR` makes development ones)")
    return 0


def cmd_model_build(args) -> int:
    out = Path(args.out) if args.out else default_model_dir(args.profile)
    started = time.monotonic()
    path = build_model(out, profile=args.profile, seed=args.seed, force=args.force)
    say(f"model '{args.profile}' ready in {path} ({time.monotonic() - started:.1f} s)")
    print(path)
    return 0


def cmd_trace(args) -> int:
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
