#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Extra arguments go to pytest.
# With none, every folder runs, fastest first (pytest.ini's testpaths):
#   scripts/test.sh -m unit         pure tests, seconds: the edit loop
#   scripts/test.sh -m "not stack"  ...and the ones against a real nats-server
#   scripts/test.sh -m stack        real NATS, vLLM engines and NIXL: minutes
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
