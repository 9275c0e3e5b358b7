#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest.
# With none, every folder runs, fastest first (pytest.ini's testpaths):
#   scripts/test.sh -m unit         pure tests, seconds: the edit loop
#   scripts/test.sh -m "not stack"  ...and the ones against a real nats-server
#   scripts/test.sh -m stack        real NATS, vLLM engines and NIXL: minutes
#   scripts/test.sh -m bench        kvpush bench against vllm serve, tiny: minutes
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The metrics test scrapes the stack with a real Prometheus server: Debian's package.
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing Debian's prometheus (the metrics test scrapes the stack with it)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
  else
    echo "[test] no prometheus server: install it (apt-get install prometheus) or the metrics test fails"
  fi
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
