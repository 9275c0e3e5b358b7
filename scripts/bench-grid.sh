#!/usr/bin/env bash
# The benchmark grid of docs/benchmarks.md: kvpush push, kvpush pull, vLLM's NixlConnector
# and NixlPushConnector, side by side; then the transfer micro-benchmark.
# About 30-40 minutes on a 2-core machine. Keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${1:-docs/bench}
# A non-zero exit only means some request failed; the results say which.
.venv/bin/kvpush bench --profile small --input-lens 1024,4096 --requests 20 --out "$OUT/small" || true
.venv/bin/kvpush bench --profile kv-heavy --input-lens 1024 --requests 16 --out "$OUT/kv-heavy" || true
.venv/bin/kvpush bench-transfer --out "$OUT/transfer.json"
