#!/usr/bin/env bash
cd "$(git rev-parse --show-toplevel)"
for yield_us in 20000; do
  KVPUSH_SHM_SPIN=backoff KVPUSH_SHM_SPIN_YIELD_US=$yield_us timeout 900 .venv/bin/kvpush bench --systems kvpush-push,kvpush-pull --input-lens 1024 --rates 0.5 \
    --requests 16 --warmup 1 --binding kvpush=auto --no-raw-nixl --at-rest-s 10 --prefill-tp 2 --decode-tp 2 \
    --out docs/bench/tp-44/spin/backoff-$yield_us > docs/bench/tp-44/spin/backoff-$yield_us.log 2>&1
  echo "backoff-$yield_us rc=$? $(date +%T)" >> docs/bench/tp-44/spin/done.txt
done
