"""``kvpush soak``, added to ``kvpush`` through the ``kvpush.commands`` entry points
(pyproject.toml). The parser only: the command's function (``soak.cmd``) is imported when
it runs."""

from __future__ import annotations

from kvpush.services.cli.commands import lazy


def register_soak(sub) -> None:
    soak = sub.add_parser("soak", help="requests under every kind of fault for a while; then what was lost, "
                                       "wrong or leaked (nothing, or exit 1)")
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson arrivals)")
    soak.add_argument("--fault-every-s", type=float, default=20.0, help="one fault, of each kind in turn, this often")
    soak.add_argument("--model", help="a local model folder (default: the built-in small model)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--out", default="soak-results")
    soak.set_defaults(func=lazy("kvpush.tools.reliability.soak:cmd"))
