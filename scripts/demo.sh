#!/usr/bin/env bash
# The main job on a fresh machine: set up, build the small model, start NATS + scheduler +
# a prefill and a decode worker, stream a few requests through NATS, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvpush model build
exec .venv/bin/kvpush demo "$@"
