#!/usr/bin/env bash
# The transfer path on a GPU, in one call (tools/gpu_check/):
#
#   scripts/gpu-check.sh --pack [DIR]   here: build the carry folder (default build/gpu-pack, <= 60 MiB):
#                                        the cp312 CUDA 13 NIXL wheels and what else the device lacks, xz-repacked
#   scripts/gpu-check.sh --cpu [OUT]    here or in CI: the same check with the KV in CPU memory
#   scripts/gpu-check.sh [CARRY]        on the lent GPU machine (the repository's root, the carry folder
#                                        carried as build/gpu-pack): unpack into a venv over the system torch,
#                                        run the check on CUDA memory within 8 minutes, everything under $OUT
#
# From this machine, with a device lent (the device tool's run):
#   scripts/gpu-check.sh --pack
#   run(command="bash scripts/gpu-check.sh", carry=["build/gpu-pack"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

case "${1:-}" in
  --pack)
    bash scripts/setup.sh >/dev/null
    exec .venv/bin/python -m kvpush.tools.gpu_check.pack pack --out "${2:-build/gpu-pack}"
    ;;
  --cpu)
    bash scripts/setup.sh >/dev/null
    exec .venv/bin/python -m kvpush.tools.gpu_check.check --device cpu --out "${2:-build/gpu-check-cpu}"
    ;;
esac

CARRY=${1:-build/gpu-pack}
OUT=${OUT:-$ROOT/build/gpu-check-out}
mkdir -p "$OUT"
PY=$(command -v python3.12 || command -v python3)
WORK=$(mktemp -d)
{
  echo "[gpu-check] $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" --version
} | tee "$OUT/machine.txt"
if "$PY" -m venv --system-site-packages --without-pip "$WORK/venv" 2>/dev/null; then
  VPY="$WORK/venv/bin/python"
  SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  EXTRA=""
else  # no venv module (Debian without python3-venv): a folder on PYTHONPATH instead
  echo "[gpu-check] no venv module: the packages go on PYTHONPATH"
  VPY="$PY"
  SITE="$WORK/site"
  EXTRA=":$SITE"
fi
"$VPY" tools/gpu_check/pack.py unpack --carry "$CARRY" --site-packages "$SITE" | sed 's/^/[gpu-check] unpacked /'
"$VPY" tools/gpu_check/pack.py kvpush-path --repository "$ROOT" --into "$WORK/path" >/dev/null
PYTHONPATH="${EXTRA#:}" "$VPY" -c 'import torch; print("[gpu-check] torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' | tee -a "$OUT/machine.txt"
# From outside the repository: python -m puts the working folder first, and the root's
# kvpush/ (the client alone) would hide the package made of its folders.
cd "$WORK"
PYTHONPATH="$WORK/path$EXTRA" timeout 480 "$VPY" -m kvpush.tools.gpu_check.check --device cuda --out "$OUT" 2>&1 \
  | tee "$OUT/check.log"
