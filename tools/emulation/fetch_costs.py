"""Where fetching a conversation's prefix stops paying, by the emulation's time model
(``kvpush.tools.emulation.time_model``, the modeled GPUs of ``catalog``; no measurement):
for each deployment, what computing a held prefix again costs against reading its KV over
the deployment's link, the link rate below which reading is slower, and the shortest
prefix worth fetching at a given fixed cost per fetch.

    python -m kvpush.tools.emulation.fetch_costs [--suffix 256] [--fixed-ms 5,20,50]
"""

from __future__ import annotations

import argparse

from kvpush.tools.emulation import catalog
from kvpush.tools.emulation.time_model import (fetch_break_even_link, fetch_break_even_tokens, fetch_seconds,
                                               recompute_seconds)

PREFIXES = (1024, 2048, 4096, 8192, 16384, 32768)


def table(suffix: int, fixed_ms: tuple[float, ...]) -> str:
    lines = [f"A turn's {suffix} new tokens computed over its history; the history computed again, or read over "
             "the deployment's link (bytes only, then with each fixed cost).", "",
             "| deployment | history | recompute | read (bytes) | read / recompute | link below which reading "
             "is slower |", "|---|---:|---:|---:|---:|---:|"]
    for name in catalog.DEPLOYMENTS:
        deployment = catalog.deployment(name)
        for prefix in PREFIXES:
            recompute = recompute_seconds(deployment, prefix, suffix)
            read = fetch_seconds(deployment, prefix, 0.0)
            link = fetch_break_even_link(deployment, prefix, suffix)
            lines.append(f"| {name} | {prefix} | {recompute * 1000:.1f} ms | {read * 1000:.2f} ms | "
                         f"{read / recompute:.3f} | {link * 8 / 1e9:.0f} Gbit/s |")
    lines += ["", "| deployment | fixed cost per fetch | shortest history worth fetching |", "|---|---:|---:|"]
    for name in catalog.DEPLOYMENTS:
        deployment = catalog.deployment(name)
        for fixed in fixed_ms:
            tokens = fetch_break_even_tokens(deployment, suffix, fixed / 1000)
            lines.append(f"| {name} | {fixed:g} ms | {tokens if tokens is not None else 'never'} tokens |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suffix", type=int, default=256, help="a turn's new tokens (its message and the last answer)")
    parser.add_argument("--fixed-ms", default="5,20,50", help="fixed costs per fetch to show, ms, comma-separated")
    args = parser.parse_args(argv)
    print(table(args.suffix, tuple(float(x) for x in args.fixed_ms.split(","))), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
