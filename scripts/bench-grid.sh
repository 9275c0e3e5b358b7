#!/usr/bin/env bash
# The benchmark of docs/benchmarks.md: kvpush push and pull against vLLM's own
# disaggregated serving (vllm serve + NixlConnector / NixlPushConnector behind their
# example proxies), one client (vllm bench serve) for all, on the kv-heavy model:
# each system's binding probed, then 1k / 4k / 8k / mixed-length prompts (1P1D) and
# 1P2D / 2P1D. Over an hour on a 2-core machine (docs/benchmarks.md says what its
# last run left out); keep the machine otherwise idle.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${1:-docs/bench}
# A non-zero exit only means some request or point failed; the results say which.
.venv/bin/kvpush bench --out "$OUT" || true
.venv/bin/kvpush bench-transfer --out "$OUT/transfer.json"
