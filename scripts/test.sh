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
# The compose check (tests/stack/test_compose_up.py) starts a private Docker engine and
# builds its base image: Debian's docker.io and debootstrap. Without them it fails, saying so.
if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing Debian's docker.io and debootstrap (the compose check runs a private engine)"
    export DEBIAN_FRONTEND=noninteractive
    # and no system engine (default socket, private-range bridge): no service may start meanwhile
    policy=""; [ -e /usr/sbin/policy-rc.d ] || { policy=/usr/sbin/policy-rc.d; printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; }
    apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends docker.io debootstrap >/dev/null; }
    [ -z "$policy" ] || rm -f "$policy"
  else
    echo "[test] no dockerd/debootstrap: install them as root (apt-get install docker.io debootstrap) or the compose check fails"
  fi
fi
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
