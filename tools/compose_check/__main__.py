"""python -m kvpush.tools.compose_check [--report FILE] [--logs DIR]: run the compose check, print
what it did and how long each step took; exit 0 when everything held, 1 when something did
not, 2 when no Docker engine could start (a failure too: the check is never skipped)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpush.tools.compose_check.check import Check


def summary(report: dict) -> str:
    lines = []
    engine = report.get("engine") or {}
    if engine:
        lines.append(f"engine: dockerd {engine.get('version')} (API {engine.get('api_version')}, "
                     f"{engine.get('storage_driver')}), Docker Compose {engine.get('compose')}")
    for row in report.get("requests", []):
        lines.append(f"  {'equal' if row['equal'] else 'DIFFERS'}  {row['name']} via {row['via']}")
    for request_id, trace in (report.get("traces") or {}).items():
        lines.append(f"  trace {request_id}: {len(trace['trace_ids'])} trace, {trace['spans']} spans from "
                     f"{', '.join(trace['services'])}")
    lines.append("times (s): " + ", ".join(f"{k} {v}" for k, v in report["times_s"].items()))
    for finding in report["findings"]:
        lines.append(f"note: {finding}")
    for failure in report["failures"]:
        lines.append(f"FAILED: {failure}")
    lines.append("compose check: " + ("passed" if report["ok"] else "FAILED"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compose-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", help="write the whole report here as JSON")
    parser.add_argument("--logs", help="keep the build, up, stack and down logs in this folder")
    parser.add_argument("--work-parent", help="make the run's temporary folder in here (default: the system's)")
    parser.add_argument("--dockerd", default="dockerd", help="the engine binary (default: dockerd on PATH)")
    parser.add_argument("--up-timeout", type=int, default=600, help="seconds `docker compose up --wait` may take")
    args = parser.parse_args(argv)
    check = Check(work_parent=args.work_parent, logs=Path(args.logs) if args.logs else None, dockerd=args.dockerd,
                  up_timeout_s=args.up_timeout, say=lambda line: print(line, flush=True))
    report = check.run()
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(summary(report), flush=True)
    if report.get("no_engine"):
        return 2
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
